"""The cluster listener (who calls, by certificate) and the Prometheus endpoint of a Service."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
import pytest
from cryptography import x509
from prometheus_client import Counter

from runtime import (
    CLUSTER_NAME,
    CLUSTER_PREFIX,
    ChannelTLS,
    ServiceSettings,
    SettingsError,
    aio_channel,
    load_settings,
)
from runtime.pki import OPERATOR, ClusterCA, Identity, part_role
from tests.roles import legacy_certificate
from tests.runtime import _echo
from tests.runtime._support import SERVING, echo_service, health_status, running
from tests.runtime.conftest import Certs


async def test_cluster_listener_serves_only_the_clusters_certificates(
    certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    service, _ = echo_service(
        tls_cert=certs.server_cert,
        tls_key=certs.server_key,
        cluster_ca=certs.ca,
        cluster_listen="127.0.0.1:0",
    )
    member = ChannelTLS(
        ca=certs.ca, cert=certs.client_cert, key=certs.client_key, server_name=CLUSTER_NAME
    )
    stranger = ChannelTLS(
        ca=certs.ca, cert=certs.stranger_cert, key=certs.stranger_key, server_name=CLUSTER_NAME
    )
    async with running(service):
        cluster = service.cluster_address
        assert cluster is not None
        assert f"{CLUSTER_PREFIX} test {cluster}" in capsys.readouterr().out
        # The public port asks nobody for a certificate: the caller is anonymous.
        async with aio_channel(service.address, tls=ChannelTLS(ca=certs.ca)) as public:
            assert await _echo.EchoClient(public).say("whoami") == "anonymous"
        # The cluster port serves the same services, to holders of the cluster's certificates.
        async with aio_channel(cluster, tls=member) as channel:
            assert await _echo.EchoClient(channel).say("whoami") == "test-client"
            assert await health_status(channel) == SERVING
        for tls in (ChannelTLS(ca=certs.ca, server_name=CLUSTER_NAME), stranger):
            async with aio_channel(cluster, tls=tls) as refused:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await _echo.EchoClient(refused).say("whoami", deadline=2)
                assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cluster_settings_name_what_is_missing(tmp_path: Path, certs: Certs) -> None:
    ca = str(certs.ca)
    with pytest.raises(SettingsError, match="cluster_listen: needs cluster_ca"):
        load_settings(ServiceSettings, ["--cluster-listen", "127.0.0.1:0"], prog="svc")
    with pytest.raises(SettingsError, match="cluster_ca: the cluster's services want a client"):
        load_settings(ServiceSettings, ["--cluster-ca", ca], prog="svc")
    with pytest.raises(SettingsError, match="cluster_ca: file not found"):
        load_settings(
            ServiceSettings,
            ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
             "--cluster-ca", str(tmp_path / "nope.pem")],
            prog="svc",
        )  # fmt: skip
    with pytest.raises(SettingsError, match="metrics_listen"):
        load_settings(ServiceSettings, ["--metrics-listen", "nope"], prog="svc")
    plain = load_settings(ServiceSettings, [], prog="svc")
    assert plain.cluster_tls is None
    member = load_settings(
        ServiceSettings,
        ["--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key),
         "--cluster-ca", ca],
        prog="svc",
    )  # fmt: skip
    assert member.cluster_tls == ChannelTLS(
        ca=certs.ca, cert=certs.client_cert, key=certs.client_key, server_name=CLUSTER_NAME
    )


_probe = Counter("nonomad_test_endpoint_probes", "Counted by the metrics endpoint test.")


async def test_metrics_endpoint_serves_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    service, _ = echo_service("flaps", metrics_listen="127.0.0.1:0")
    _probe.inc(3)
    async with running(service):
        line = next(
            ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("NONOMAD_METRICS")
        )
        _, name, address = line.split()
        assert name == "flaps"
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        )
        assert "nonomad_test_endpoint_probes_total 3.0" in body
    # Closed with the service.
    with pytest.raises(urllib.error.URLError, match="refused"):
        await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{address}/metrics", timeout=2).read()
        )


def test_cluster_ca_reuses_what_it_signed_and_keeps_keys_private(tmp_path: Path) -> None:
    ca = ClusterCA.ensure(tmp_path / "tls")
    first = ca.issue("flaps", "flaps")
    pem = first.cert.read_bytes()
    assert ClusterCA.ensure(tmp_path / "tls").issue("flaps", "flaps") == first
    assert first.cert.read_bytes() == pem
    for path in (ca.path, tmp_path / "tls" / "ca.key", first.cert, first.key):
        assert path.stat().st_mode & 0o777 == 0o600, path
    # A certificate another CA signed is replaced, not trusted.
    other = ClusterCA.ensure(tmp_path / "other")
    (tmp_path / "other" / "flaps.pem").write_bytes(first.cert.read_bytes())
    (tmp_path / "other" / "flaps.key").write_bytes(first.key.read_bytes())
    reissued = other.issue("flaps", "flaps")
    assert reissued.cert.read_bytes() != first.cert.read_bytes()


def _identity(path: Path) -> Identity:
    return Identity.of(x509.load_pem_x509_certificate(path.read_bytes()))


def test_every_certificate_names_its_role_and_one_without_is_issued_again(
    tmp_path: Path,
) -> None:
    ca = ClusterCA.ensure(tmp_path / "tls")
    worker = ca.issue("flyd-ams-1", "flyd")
    assert _identity(worker.cert) == Identity("flyd-ams-1", "flyd")
    assert _identity(worker.cert).worker_id == "ams-1"
    assert _identity(ca.issue("cli", OPERATOR).cert).worker_id is None
    # Made before roles (a common name only): issued again, in its role, by the same call.
    old = legacy_certificate(tmp_path / "tls", "proxy")
    old.cert.rename(tmp_path / "tls" / "proxy.pem")
    old.key.rename(tmp_path / "tls" / "proxy.key")
    assert _identity(tmp_path / "tls" / "proxy.pem") == Identity("proxy", None)
    assert _identity(ca.issue("proxy", "proxy").cert) == Identity("proxy", "proxy")
    # Another role asked for the same part: issued again too.
    assert _identity(ca.issue("proxy", "console").cert) == Identity("proxy", "console")
    for name, role, words in [
        ("flyd", "flyd", "flyd-<worker id>"),
        ("proxy", "admin", "not one of"),
    ]:
        with pytest.raises(ValueError, match=words):
            ca.issue(name, role)


@pytest.mark.parametrize(
    ("part", "role"),
    [("flaps", "flaps"), ("proxy-ams", "proxy"), ("flyd-ams-1", "flyd"), ("cli", OPERATOR),
     ("console", "console"), ("registry", "registry")],
)  # fmt: skip
def test_each_part_of_the_cluster_has_a_role_by_its_name(part: str, role: str) -> None:
    assert part_role(part) == role


@pytest.mark.parametrize("part", ["flyd", "flyd-", "intruder", "admin"])
def test_a_part_with_no_role_is_named_in_the_error(part: str) -> None:
    with pytest.raises(ValueError, match=f"part {part!r}"):
        part_role(part)
