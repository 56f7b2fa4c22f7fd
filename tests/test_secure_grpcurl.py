"""A secure flyd and flaps (as `nonomad up` runs them), driven with the real grpcurl binary the
way the README shows: flaps over TLS with `-cacert` and a token, health and reflection open;
flyd only for a client with a cluster certificate."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from model.tokens import read_token
from nonomad.security import ClusterSecurity
from runtime.pki import OPERATOR, CertPaths, ClusterCA
from tests import host_ports
from tests.conftest import _kill_machines
from tests.harness import ServiceProcess, clean_env, flyd_args, grpcurl
from tests.roles import legacy_certificate

LIST_REGIONS = "flaps.v1.PlatformService/ListRegions"
# A refused handshake is retried until the connect timeout: it need not be grpcurl's 10 s.
QUICK = ["-connect-timeout", "1"]


@pytest.fixture(scope="module")
def flyd(
    tmp_path_factory: pytest.TempPathFactory, image_source: Path, security: ClusterSecurity
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("secure-flyd")
    args = flyd_args(
        tmp / "data", image_source, "w1", "ams", "--ports", host_ports.flag(host_ports.block())
    )
    proc = ServiceProcess(
        "flyd", [*args, *security.worker_args("w1")], tmp / "flyd.log", env=clean_env()
    ).start()
    try:
        yield proc.address
    finally:
        proc.kill()
        _kill_machines(tmp / "data")


@pytest.fixture(scope="module")
def flaps(
    flyd: str, tmp_path_factory: pytest.TempPathFactory, security: ClusterSecurity
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("secure-flaps")
    args = ["--listen", "127.0.0.1:0", "--workers", flyd, *security.flaps_args()]
    proc = ServiceProcess("flaps", args, tmp / "flaps.log", env=clean_env()).start()
    yield proc.address
    assert proc.terminate() == 0


def bearer(token: str) -> list[str]:
    return ["-H", f"authorization: Bearer {token}"]


def test_flaps_over_tls_with_a_token(flaps: str, security: ClusterSecurity) -> None:
    ca = ["-cacert", str(security.ca)]
    admin = read_token(security.admin_token)
    # Reflection and health need no token.
    listed = grpcurl(*ca, flaps, "list")
    assert listed.returncode == 0, listed.stderr
    assert "flaps.v1.MachinesService" in listed.stdout.split()
    health = grpcurl(*ca, flaps, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING", health.stderr
    # The API needs one, and says what is wrong.
    ok = grpcurl(*ca, *bearer(admin), "-d", "{}", flaps, LIST_REGIONS)
    assert ok.returncode == 0, ok.stderr
    missing = grpcurl(*ca, "-d", "{}", flaps, LIST_REGIONS)
    assert "Unauthenticated" in missing.stderr, missing.stderr
    assert "missing `authorization: Bearer <token>`" in missing.stderr
    reader = security.keyring().mint(["apps = demo", "ops = read"])
    denied = grpcurl(*ca, *bearer(reader), "-d", "{}", flaps, LIST_REGIONS)
    assert "PermissionDenied" in denied.stderr, denied.stderr
    assert 'token caveat "ops = read" does not allow operation regions' in denied.stderr
    assert "TOKEN_CAVEAT" in denied.stderr  # the ErrorInfo's reason
    # TLS it is: plaintext does not get an answer.
    plain = grpcurl("-plaintext", *QUICK, *bearer(admin), "-d", "{}", flaps, LIST_REGIONS)
    assert plain.returncode != 0


def test_flyd_serves_only_clients_with_a_cluster_certificate(
    flyd: str, security: ClusterSecurity, tmp_path: Path
) -> None:
    ca = ["-cacert", str(security.ca)]
    cli = security.cert("cli")
    member = grpcurl(*ca, "-cert", str(cli.cert), "-key", str(cli.key), flyd,
                     "flyd.v1.WorkerService/GetCapacity")  # fmt: skip
    assert member.returncode == 0, member.stderr
    assert "capacity" in json.loads(member.stdout)
    stranger = ClusterCA.ensure(tmp_path / "other").issue("cli", OPERATOR)
    for refused in (
        ["-plaintext"],  # no TLS at all
        ca,  # TLS, no client certificate
        ["-insecure"],  # not even checking flyd's: still no certificate of its own
        [*ca, "-cert", str(stranger.cert), "-key", str(stranger.key)],  # another CA's
    ):
        got = grpcurl(*refused, *QUICK, flyd, "flyd.v1.WorkerService/GetCapacity")
        assert got.returncode != 0, (refused, got.stdout)
        assert "capacity" not in got.stdout
    # Not even health or reflection: the certificate is checked before any call.
    assert grpcurl(*ca, *QUICK, flyd, "list").returncode != 0


def test_flyd_serves_each_certificate_what_its_role_may_call(
    flyd: str, security: ClusterSecurity
) -> None:
    """The operator reads capacity, nothing more; the console creates nothing; a certificate
    the cluster's CA signed before roles is refused, naming why."""
    ca = ["-cacert", str(security.ca)]

    def as_part(paths: CertPaths, rpc: str, body: str = "{}") -> subprocess.CompletedProcess[str]:
        return grpcurl(*ca, "-cert", str(paths.cert), "-key", str(paths.key), "-d", body, flyd,
                       f"flyd.v1.WorkerService/{rpc}")  # fmt: skip

    cli = security.cert("cli")
    for rpc in ("CreateMachine", "ListMachines", "RevealSecrets"):
        refused = as_part(cli, rpc)
        assert "PermissionDenied" in refused.stderr, (rpc, refused.stderr)
        assert "'cli' (role operator) may not call" in refused.stderr, refused.stderr
        assert "CERTIFICATE_ROLE" in refused.stderr  # the ErrorInfo's reason
    console = security.cert("console")
    created = as_part(console, "CreateMachine", '{"app": "evil", "config": {"image": "x"}}')
    assert "'console' (role console) may not call" in created.stderr, created.stderr
    old = legacy_certificate(security.ca.parent, "flaps")  # the cluster's CA, no role
    for rpc in ("GetCapacity", "CreateMachine"):
        refused = as_part(old, rpc)
        assert "PermissionDenied" in refused.stderr, refused.stderr
        assert "names no role" in refused.stderr, refused.stderr
