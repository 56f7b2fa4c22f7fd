"""Who may call flaps for what: every Machines and Platform RPC against every kind of token,
and every RPC of its cluster port against every role of certificate.

flaps runs in-process as flaps.main wires it (servicers guarded by flaps.auth, then wrapped
by map_error; the registry and the token service by their role tables), over TLS with a
cluster port, in front of the fake fleet of tests/flaps/support.py. App `a` has machine A and
app `b` machine B. Each request in `CALLS` is harmless when allowed (an unknown signal, a bad
config, destroying a started machine without force...): what is checked is whether the call
got past the token, not what it did.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from pymacaroons import Macaroon

from flaps import auth, placement
from flaps.auth import KeySource, RevocationList
from flaps.service import Exchange, Workers
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc, tokens_pb2, tokens_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from model.tokens import DEFAULT_TTL, InvalidToken, Keyring, attenuate, caveats, new_key_line
from model.tokens import inspect as inspect_token
from nonomad.security import ClusterSecurity
from registry.replica import Replica
from registry.v1 import registry_pb2, registry_pb2_grpc
from runtime import CLUSTER_NAME, ChannelTLS
from runtime.pki import ClusterCA, ClusterMembers, Identity, part_role, write_private
from tests.flaps.auth_support import (
    BAD_SIGNAL,
    CALLS,
    DENIED,
    KEY,
    REGISTRY,
    STUBS,
    TOKENS,
    Call,
    Flaps,
    flaps,
)
from tests.flyd.support import config
from tests.harness import channel, error_info
from tests.roles import legacy_certificate
from tests.servicers import T

__all__ = ["flaps"]

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
OTHER_KEY = new_key_line("k1")  # same id, another secret: a forged signature
ROTATED = new_key_line("k2")


# -- the table: every RPC, a harmless request on app a's or app b's machine ----------------------

# The registry flaps embeds: for the cluster's parts only (no token gets past).
REGISTRY_CALLS: list[Call] = [
    (REGISTRY, "Announce", lambda mid, app: registry_pb2.AnnounceRequest(
        worker=pb.WorkerInfo(id="Not A Worker"))),
    (REGISTRY, "ListMembers", lambda mid, app: registry_pb2.ListMembersRequest()),
    (REGISTRY, "Follow", lambda mid, app: registry_pb2.FollowRequest()),
    (REGISTRY, "ListSlot", lambda mid, app: registry_pb2.ListSlotRequest(app=app, slot="s")),
]  # fmt: skip
# The token service: for the edge's certificate only.
TOKEN_CALLS: list[Call] = [
    (TOKENS, "VerifyToken", lambda mid, app: tokens_pb2.VerifyTokenRequest(token="not-a-token")),
]
READS = {
    "GetMachine",
    "ListMachines",
    "WaitMachine",
    "ListMachineEvents",
    "GetMachineLogs",
    "GetPlacement",
}
FLEET = {"ListRegions": "regions", "ListWorkers": "workers", "CordonWorker": "cordon"}
WATCH = "WatchPlacements"
"""Every app's decisions: read and regions, with an operator token."""


def test_the_tables_cover_every_rpc_and_every_rpc_has_a_rule() -> None:
    def served(*services: Any) -> set[str]:
        return {f"/{d.full_name}/{method.name}" for d in services for method in d.methods}

    api = served(
        m.DESCRIPTOR.services_by_name["MachinesService"],
        platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
    )
    cluster_only = served(
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        tokens_pb2.DESCRIPTOR.services_by_name["TokenService"],
    )
    assert {rpc for _, rpc, _ in CALLS} == {name.rsplit("/", 1)[1] for name in api}
    calls = [*REGISTRY_CALLS, *TOKEN_CALLS]
    assert {rpc for _, rpc, _ in calls} == {name.rsplit("/", 1)[1] for name in cluster_only}
    assert set(auth.RULES) == set(auth.PEER_ACCESS) == api


async def outcome(
    f: Flaps, call: Call, token: str | None, app: str, peer: str | None = None
) -> grpc.aio.AioRpcError | None:
    """Make the call on app `app` (its machine) with `token`, or on flaps' cluster port with
    the cluster certificate of part `peer`: None if it got past the check, else the error that
    stopped it there (UNAUTHENTICATED or PERMISSION_DENIED)."""
    service, rpc, request = call
    if peer is None:
        stub = f.stub(STUBS[service], token)
    else:
        stub = STUBS[service](channel(f.cluster_address, f.security.member_tls(peer)))
    mid = f.a if app == "a" else f.b
    try:
        answer = getattr(stub, rpc)(request(mid, app), timeout=T)
        if rpc == WATCH:  # endless; its headers come once it is subscribed, or its refusal
            await answer.initial_metadata()
            if answer.done():
                await answer.read()  # raises its error
            answer.cancel()
        elif isinstance(answer, grpc.aio.UnaryStreamCall):
            await answer.read()
            answer.cancel()
        else:
            await answer
    except grpc.aio.AioRpcError as err:
        if err.code() in (UNAUTHENTICATED, DENIED):
            return err
    return None


def denied_by(err: grpc.aio.AioRpcError | None, caveat: str) -> bool:
    if err is None or err.code() != DENIED:
        return False
    info = error_info(err)
    assert info is not None
    assert info[0] == "TOKEN_CAVEAT"
    assert caveat in (err.details() or "")
    return info[2]["caveat"] == caveat


async def test_a_token_for_app_a_cannot_read_or_change_app_b(flaps: Flaps) -> None:
    token = flaps.mint("apps = a", "ops = deploy")
    for call in CALLS:
        rpc = call[1]
        if rpc in FLEET or rpc == WATCH:  # the fleet is no app's: an app token has no view
            assert denied_by(await outcome(flaps, call, token, "a"), "ops = deploy"), rpc
            continue
        assert await outcome(flaps, call, token, "a") is None, rpc
        assert denied_by(await outcome(flaps, call, token, "b"), "apps = a"), rpc


async def test_a_read_only_token_reads_and_cannot_write(flaps: Flaps) -> None:
    token = flaps.mint("apps = a,b", "ops = read")
    for call in CALLS:
        rpc = call[1]
        got = await outcome(flaps, call, token, "a")
        if rpc in READS:
            assert got is None, rpc
        else:
            assert denied_by(got, "ops = read"), rpc


async def test_the_admin_operations_are_the_fleets(flaps: Flaps) -> None:
    token = flaps.mint("ops = admin")
    for call in CALLS:
        got = await outcome(flaps, call, token, "b")
        if call[1] in FLEET:
            assert got is None, call[1]
        else:
            assert denied_by(got, "ops = admin"), call[1]


async def test_watching_placements_takes_read_and_regions_on_every_app(flaps: Flaps) -> None:
    watch = next(call for call in CALLS if call[1] == WATCH)
    assert await outcome(flaps, watch, flaps.mint("ops = read,regions"), "a") is None
    only_a = flaps.mint("apps = a", "ops = read,regions")
    assert denied_by(await outcome(flaps, watch, only_a, "a"), "apps = a")


def tampered(token: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    raw[-5] ^= 0x01  # a bit of the signature
    return base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")


BAD_TOKENS: list[tuple[str, Callable[[Flaps], str | None], str]] = [
    ("missing", lambda f: None, "missing `authorization: Bearer"),
    ("garbage", lambda f: "not-a-macaroon", "not a nonomad token"),
    ("expired", lambda f: f.mint(f"expires = {int(time.time()) - 1}"), "expired at"),
    ("tampered", lambda f: tampered(f.mint("apps = a")), "bad signature"),
    ("wrong key", lambda f: f.mint(keys=OTHER_KEY), "bad signature"),
    ("unknown key", lambda f: f.mint(keys=ROTATED), "a key this flaps does not hold"),
    # A caveat flaps does not understand fails closed, whoever added it.
    ("unknown caveat", lambda f: with_caveat(f.mint(), "region = ams"), "unknown key 'region'"),
    # Minted before every token had to expire: refused, not honoured for ever.
    ("never expires", lambda f: unexpiring(KEY), "never expires"),
]


def unexpiring(keys: str) -> str:
    """A token as `mint` made them before expiries were required: no `expires` caveat."""
    key_id, _, secret = keys.partition(" ")
    key = base64.urlsafe_b64decode(secret + "=" * (-len(secret) % 4))
    return str(Macaroon(location="nonomad", identifier=f"nonomad1 {key_id} 0123456789abcdef",
                        key=key).serialize())  # fmt: skip


def with_caveat(token: str, text: str) -> str:
    """Add any caveat, as pymacaroons lets a holder do (model.tokens.attenuate checks them)."""
    macaroon = Macaroon.deserialize(token)
    macaroon.add_first_party_caveat(text)
    return str(macaroon.serialize())


@pytest.mark.parametrize(("case", "make", "message"), BAD_TOKENS, ids=[c[0] for c in BAD_TOKENS])
async def test_bad_tokens_are_unauthenticated_on_every_rpc(
    flaps: Flaps, case: str, make: Callable[[Flaps], str | None], message: str
) -> None:
    token = make(flaps)
    for call in CALLS:
        err = await outcome(flaps, call, token, "a")
        assert err is not None, (case, call[1])
        assert err.code() == UNAUTHENTICATED, (case, call[1], err.details())
        assert message in (err.details() or ""), (case, err.details())


async def denial(f: Flaps, call: Call, token: str, app: str) -> str | None:
    """The caveat that refused the call on app `app` (PERMISSION_DENIED), or None when it got
    past the token."""
    err = await outcome(f, call, token, app)
    if err is None:
        return None
    assert err.code() == DENIED, (call[1], err.details())
    info = error_info(err)
    assert info is not None
    return info[2]["caveat"]


async def test_attenuation_only_narrows_on_every_rpc(flaps: Flaps) -> None:
    admin = flaps.mint()
    narrowed = attenuate(admin, caveats(apps=["a"], ops=["read"]))
    widened = attenuate(narrowed, caveats(apps=["*"], ops=["*"]))  # cannot undo the first
    only_a = f"machines = {flaps.a}"
    one_machine = attenuate(admin, caveats(machines=[flaps.a]))
    for call in CALLS:
        rpc = call[1]
        for app in ("a", "b"):
            expected = "ops = read" if rpc not in READS else "apps = a" if app == "b" else None
            assert await denial(flaps, call, narrowed, app) == expected, (rpc, app)
            assert await denial(flaps, call, widened, app) == expected, (rpc, app)
        # A machines caveat allows calls on those machines and calls that name none (a list
        # is filtered), and refuses every create and every fleet operation (those take an
        # operator token).
        refused = rpc in ("CreateMachine", "SimulatePlacement", WATCH, *FLEET)
        names_one = rpc != "ListMachines" and not refused
        assert await denial(flaps, call, one_machine, "a") == (only_a if refused else None), rpc
        on_b = only_a if refused or names_one else None
        assert await denial(flaps, call, one_machine, "b") == on_b, rpc


async def test_lists_return_only_what_the_token_may_read(flaps: Flaps) -> None:
    only_a = flaps.stub(machines_pb2_grpc.MachinesServiceStub, flaps.mint("apps = a"))
    listed = await only_a.ListMachines(m.ListMachinesRequest(), timeout=T)
    assert [mm.id for mm in listed.machines] == [flaps.a]
    admin = flaps.stub(machines_pb2_grpc.MachinesServiceStub, flaps.mint())
    everything = await admin.ListMachines(m.ListMachinesRequest(), timeout=T)
    assert {mm.id for mm in everything.machines} == {flaps.a, flaps.b}
    one = flaps.stub(machines_pb2_grpc.MachinesServiceStub, flaps.mint(f"machines = {flaps.b}"))
    listed = await one.ListMachines(m.ListMachinesRequest(), timeout=T)
    assert [mm.id for mm in listed.machines] == [flaps.b]


async def test_rotation_accepts_old_and_new_keys_until_the_old_one_goes(flaps: Flaps) -> None:
    old = flaps.mint()
    # The new key goes first: it mints; the old one still verifies.
    flaps.keyring[0] = Keyring.parse(f"{ROTATED}\n{KEY}")
    new = flaps.keyring[0].mint([])
    for call in CALLS:
        assert await outcome(flaps, call, old, "a") is None, call[1]
        assert await outcome(flaps, call, new, "a") is None, call[1]
    # The old key is dropped: its tokens stop working, the new ones go on.
    flaps.keyring[0] = Keyring.parse(ROTATED)
    for call in CALLS:
        err = await outcome(flaps, call, old, "a")
        assert err is not None, call[1]
        assert err.code() == UNAUTHENTICATED, call[1]
        assert await outcome(flaps, call, new, "a") is None, call[1]


def test_the_keys_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token-keys"
    write_private(path, f"{KEY}\n".encode())
    source = KeySource(path)
    assert source.keyring.ids == ["k1"]
    assert not source.reload()
    write_private(path, f"{ROTATED}\n{KEY}\n".encode())
    assert source.reload()
    assert (source.keyring.current, source.keyring.ids) == ("k2", ["k2", "k1"])
    # A broken file does not take the keys away.
    write_private(path, b"k3 too-short\n")
    assert not source.reload()
    assert source.keyring.ids == ["k2", "k1"]
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        KeySource(path)


FOLLOW = {"ListMembers", "Follow"}
OPERATOR_READS = READS | {"ListRegions", "ListWorkers", "WatchPlacements"}
PEERS: list[tuple[str, set[str]]] = [
    # Starts a stopped machine for a request or promotes a standby, stops an idle one, tells
    # an outranked copy; its replica follows flaps'; it asks flaps about the tokens of pins.
    ("proxy", FOLLOW | {"StartMachine", "StopMachine", "SupersedeMachine", "VerifyToken"}),
    ("console", FOLLOW),  # its replica; it reads the rest with its token, on the public port
    ("cli", OPERATOR_READS),  # the operator reads; every change takes a token
    ("flyd-w1", {"ListSlot"}),  # its Announce of "Not A Worker" is refused: not itself
    ("registry", FOLLOW | {"Announce"}),  # a relay: passes on what workers told it
    ("flaps", FOLLOW | {"Announce"}),
]
"""What the certificate of each part may call on flaps' cluster port; everything else is
PERMISSION_DENIED naming the certificate and its role."""


def role_denied(err: grpc.aio.AioRpcError | None, part: str, role: str | None) -> bool:
    """Whether the call was refused for its certificate's role, naming both."""
    if err is None or err.code() != DENIED:
        return False
    info = error_info(err)
    assert info is not None
    assert (info[0], info[2]["certificate"], info[2]["role"]) == (
        "CERTIFICATE_ROLE",
        part,
        role or "",
    ), info
    assert f"cluster certificate {part!r}" in (err.details() or "")
    return True


@pytest.mark.parametrize(("peer", "allowed"), PEERS, ids=[p[0] for p in PEERS])
async def test_each_cluster_certificate_may_call_what_its_role_needs(
    flaps: Flaps, peer: str, allowed: set[str]
) -> None:
    role = part_role(peer)
    ClusterCA.ensure(flaps.security.ca.parent).issue(peer, role)  # made once, then reused
    for call in [*CALLS, *REGISTRY_CALLS, *TOKEN_CALLS]:
        rpc = call[1]
        err = await outcome(flaps, call, None, "b", peer=peer)
        if rpc in allowed:
            assert err is None, (peer, rpc, err and err.details())
        else:
            assert role_denied(err, peer, role), (peer, rpc, err and err.details())
            assert f"role {role}" in (err.details() or ""), (peer, rpc)


async def test_a_certificate_without_a_role_is_refused_everything(flaps: Flaps) -> None:
    """One made before roles (its subject a common name only), signed by the cluster's CA:
    no part of today's cluster."""
    old = legacy_certificate(flaps.security.ca.parent, "proxy")
    tls = ChannelTLS(ca=flaps.security.ca, cert=old.cert, key=old.key, server_name=CLUSTER_NAME)
    for service, rpc, request in [*CALLS, *REGISTRY_CALLS, *TOKEN_CALLS]:
        stub = STUBS[service](channel(flaps.cluster_address, tls))
        answer = getattr(stub, rpc)(request(flaps.b, "b"), timeout=T)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await (answer.read() if isinstance(answer, grpc.aio.UnaryStreamCall) else answer)
        assert raised.value.code() == DENIED, rpc
        assert "names no role" in (raised.value.details() or ""), rpc


async def test_a_worker_announces_itself_and_no_other(flaps: Flaps) -> None:
    """Attack 3 on flaps' cluster port: a worker's certificate (or any other part's) setting
    another worker's address. Refused, and the address flaps knows is unchanged."""
    w1 = flaps.fleet.workers["w1"].worker.info()
    ClusterCA.ensure(flaps.security.ca.parent).issue("flyd-w2", "flyd")
    spoofed = pb.WorkerInfo()
    spoofed.CopyFrom(w1)
    spoofed.address = "127.0.0.1:9"
    for part in ("flyd-w2", "proxy", "console", "cli"):
        stub = registry_pb2_grpc.RegistryServiceStub(
            channel(flaps.cluster_address, flaps.security.member_tls(part))
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Announce(registry_pb2.AnnounceRequest(worker=spoofed), timeout=T)
        assert role_denied(raised.value, part, part_role(part)), part
        why = "announces only itself" if part == "flyd-w2" else "flaps, flyd, registry may"
        assert why in (raised.value.details() or ""), (part, raised.value.details())
        view = flaps.replica.worker("w1")
        assert view is not None
        assert view.info.address == w1.address, part
    itself = registry_pb2_grpc.RegistryServiceStub(
        channel(flaps.cluster_address, flaps.security.member_tls("flyd-w2"))
    )
    w2 = flaps.fleet.workers["w2"].worker.info()
    await itself.Announce(registry_pb2.AnnounceRequest(worker=w2), timeout=T)
    assert flaps.replica.worker("w2") is not None


async def test_the_registry_is_for_the_clusters_parts_only(flaps: Flaps) -> None:
    request = registry_pb2.ListMembersRequest()
    public = registry_pb2_grpc.RegistryServiceStub(
        channel(flaps.address, flaps.security.client_tls(), flaps.mint())
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await public.ListMembers(request, timeout=T)
    assert raised.value.code() == DENIED
    assert "cluster certificate" in (raised.value.details() or "")
    member = registry_pb2_grpc.RegistryServiceStub(
        channel(flaps.cluster_address, flaps.security.member_tls("console"))
    )
    await member.ListMembers(request, timeout=T)
    # A part of the cluster may use the Machines API too, with no token, as far as its role
    # goes (the operator's certificate reads).
    machines = machines_pb2_grpc.MachinesServiceStub(
        channel(flaps.cluster_address, flaps.security.member_tls())
    )
    got = await machines.GetMachine(m.GetMachineRequest(machine_id=flaps.b), timeout=T)
    assert got.machine.app == "b"


async def test_a_machine_the_view_has_not_seen_is_checked_with_its_worker(
    flaps: Flaps,
) -> None:
    # A replica that knows the workers but follows none of them: it has no machines.
    blind = Replica()
    for worker_id in ("w1", "w2"):
        blind.add_worker(flaps.fleet.workers[worker_id].worker.info())
    workers = Workers(blind)
    try:
        exchange = Exchange(blind, workers, placement.Pipeline())
        assert blind.machine(flaps.b) is None
        assert await exchange.app_of(flaps.b) == "b"
    finally:
        await workers.close()


class _Context:
    def __init__(self, pem: bytes | None) -> None:
        self._auth = {"x509_pem_cert": [pem]} if pem else {}

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer_identity_key(self) -> str | None:
        return "x509_common_name" if self._auth else None


def test_only_the_cluster_cas_certificates_make_a_part_of_the_cluster(
    security: ClusterSecurity, tmp_path: Path
) -> None:
    members = ClusterMembers(security.ca)
    proxy = security.cert("proxy").cert.read_bytes()
    stranger = ClusterCA.ensure(tmp_path / "other").issue("proxy", "proxy").cert.read_bytes()
    old = legacy_certificate(security.ca.parent, "old-proxy").cert.read_bytes()
    assert members.identity_of(_Context(proxy)) == Identity("proxy", "proxy")
    assert members.identity_of(_Context(proxy)) == Identity("proxy", "proxy")  # remembered
    assert members.identity_of(_Context(stranger)) is None  # another CA, the same name
    assert members.identity_of(_Context(None)) is None
    assert members.identity_of(_Context(old)) == Identity("old-proxy", None)  # no role


def test_a_token_known_by_its_digest_still_expires() -> None:
    keys = Keyring.parse(KEY)
    token = keys.mint([f"expires = {int(time.time()) + 60}"])
    assert keys.verify(token).token_id == keys.verify(token).token_id  # the second: known
    with pytest.raises(InvalidToken, match="expired at"):
        keys.verify(token, now=time.time() + 120)
    # A token one character off is another token: its signature is checked, and fails.
    with pytest.raises(InvalidToken):
        keys.verify(tampered(token))


def with_secrets(**values: str) -> pb.MachineConfig:
    made = config()
    made.secrets.update(values)
    return made


async def test_secrets_copy_only_from_a_machine_of_the_app_the_token_may_update(
    flaps: Flaps,
) -> None:
    """secrets_from: the new machine gets the source's secrets it does not set itself; the
    token must be allowed to update the source, which must be of the same app."""
    admin = flaps.stub(machines_pb2_grpc.MachinesServiceStub, flaps.mint())
    source = await admin.CreateMachine(
        m.CreateMachineRequest(
            app="a", region="ams", config=with_secrets(KEY_A="one", KEY_B="two")
        ),
        timeout=T,
    )
    src = source.machine.id
    await flaps.fleet.seen(src)

    def create(app: str, cfg: pb.MachineConfig, source: str = src) -> m.CreateMachineRequest:
        return m.CreateMachineRequest(app=app, region="ams", config=cfg, secrets_from=source)

    create_only = flaps.stub(machines_pb2_grpc.MachinesServiceStub, flaps.mint("ops = create"))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await create_only.CreateMachine(create("a", config()), timeout=T)
    assert denied_by(raised.value, "ops = create")
    app_b = flaps.stub(
        machines_pb2_grpc.MachinesServiceStub, flaps.mint("apps = b", "ops = create,update")
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await app_b.CreateMachine(create("b", config()), timeout=T)
    assert denied_by(raised.value, "apps = b")

    # Refused, with the field named, and nothing created.
    before = flaps.fleet.machine_ids()
    refusals = [
        (create("b", config()), "secrets_from", "is of app 'a'"),
        (create("a", config(), f"{src}x"), "secrets_from", "not found"),
        (create("a", config(), "Bad Id"), "secrets_from", ""),
        (create("a", with_secrets(NOPE="<redacted>")), "config.secrets[NOPE]", "has no NOPE"),
    ]
    for request, field, words in refusals:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await admin.CreateMachine(request, timeout=T)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert field in (raised.value.details() or ""), raised.value.details()
        assert words in (raised.value.details() or ""), raised.value.details()
    assert flaps.fleet.machine_ids() == before

    # Allowed: what the config sets (or keeps as <redacted>) and the rest from the source.
    allowed = flaps.stub(
        machines_pb2_grpc.MachinesServiceStub, flaps.mint("apps = a", "ops = create,update")
    )
    made = await allowed.CreateMachine(
        create("a", with_secrets(KEY_B="mine", KEY_A="<redacted>")), timeout=T
    )
    assert dict(made.machine.config.secrets) == {"KEY_A": "<redacted>", "KEY_B": "<redacted>"}
    worker = flaps.fleet.owner_of(made.machine.id).worker
    assert worker.reveal_secrets(made.machine.id) == {"KEY_A": "one", "KEY_B": "mine"}
    copied = await allowed.CreateMachine(create("a", config()), timeout=T)
    owner = flaps.fleet.owner_of(copied.machine.id).worker
    assert owner.reveal_secrets(copied.machine.id) == {"KEY_A": "one", "KEY_B": "two"}


async def test_every_line_a_call_logs_names_its_token(flaps: Flaps) -> None:
    """Its id, from the token's check to the error mapping's line after the handler, for a
    unary call and a stream; the token itself in none."""
    token = flaps.mint("ops = read,stop")
    token_id = inspect_token(token).token_id
    machines = flaps.stub(machines_pb2_grpc.MachinesServiceStub, token)
    unknown = f"{flaps.a.rpartition('-')[0]}-000000000000"  # on a known worker: its NOT_FOUND
    with structlog.testing.capture_logs([structlog.contextvars.merge_contextvars]) as logs:
        with pytest.raises(grpc.aio.AioRpcError):  # flaps maps the worker's INVALID_ARGUMENT
            await machines.StopMachine(
                m.StopMachineRequest(machine_id=flaps.a, signal=BAD_SIGNAL), timeout=T
            )
        with pytest.raises(grpc.aio.AioRpcError):
            await machines.GetMachineLogs(m.GetMachineLogsRequest(machine_id=unknown)).read()
        with pytest.raises(grpc.aio.AioRpcError):  # denied: the caveat's line
            await machines.UpdateMachine(m.UpdateMachineRequest(machine_id=flaps.a), timeout=T)
    mine = [e for e in logs if str(e.get("method", "")).startswith("/flaps.v1.")]
    assert {(e["event"], e["method"].rsplit("/", 1)[1]) for e in mine} == {
        ("rpc_error", "StopMachine"),
        ("rpc_error", "GetMachineLogs"),
        ("permission_denied", "UpdateMachine"),
    }
    assert all(e.get("token_id") == token_id for e in mine), mine
    assert token not in repr(logs)


# -- fleet operations, expiry, revocation --------------------------------------------------------

FLEET_CALLS = [call for call in CALLS if call[1] in FLEET or call[1] == WATCH]


@pytest.mark.parametrize("ops", ["*", "admin", "read,regions,workers,cordon"])
async def test_an_app_token_never_reaches_fleet_operations(flaps: Flaps, ops: str) -> None:
    """Attack 4: a token for app `evil` with every operation (or the admin ones) lists, watches
    and cordons nothing; an operator token does. Nothing changed: w1 is not cordoned."""
    evil = flaps.mint("apps = evil", f"ops = {ops}")
    for call in FLEET_CALLS:
        got = await outcome(flaps, call, evil, "a")
        if call[1] == WATCH and ops == "admin":  # it reads too: its ops refuse it first
            assert denied_by(got, "ops = admin"), call[1]
            continue
        assert denied_by(got, "apps = evil"), call[1]
        assert got is not None
        assert "operator token" in (got.details() or ""), call[1]
    cordon = platform_pb2.CordonWorkerRequest(worker_id="w1", cordoned=True)
    platform = flaps.stub(platform_pb2_grpc.PlatformServiceStub, evil)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await platform.CordonWorker(cordon, timeout=T)
    assert raised.value.code() == DENIED
    assert not flaps.fleet.workers["w1"].worker.cordoned
    operator = flaps.mint("ops = admin,read")
    for call in FLEET_CALLS:
        assert await outcome(flaps, call, operator, "a") is None, call[1]
    assert await outcome(flaps, FLEET_CALLS[0], flaps.mint("apps = *", "ops = *"), "a") is None


def test_every_minted_token_expires_by_default() -> None:
    keys = Keyring.parse(KEY)
    now = 1_800_000_000.0
    token = keys.mint(caveats(apps=["a"], ops=["read"]), now=now)
    grant = keys.verify(token, now=now)
    assert grant.expires == int(now + DEFAULT_TTL)
    assert keys.verify(token, now=now + DEFAULT_TTL - 1).token_id == grant.token_id
    with pytest.raises(InvalidToken, match="expired at"):
        keys.verify(token, now=now + DEFAULT_TTL)
    # An expiry the caveats set is the one it has; none is added.
    short = keys.mint([f"expires = {int(now) + 60}"], now=now)
    assert inspect_token(short).caveats == (f"expires = {int(now) + 60}",)
    with pytest.raises(InvalidToken, match="never expires"):
        keys.verify(unexpiring(KEY), now=now)


async def test_a_revoked_token_is_refused_on_every_rpc(flaps: Flaps) -> None:
    token, other = flaps.mint(), flaps.mint()
    revoked = inspect_token(token).token_id
    flaps.revoked[0] = frozenset({revoked})
    for call in CALLS:
        err = await outcome(flaps, call, token, "a")
        assert err is not None
        assert err.code() == UNAUTHENTICATED, call[1]
        assert f"token {revoked} was revoked" in (err.details() or ""), call[1]
        assert await outcome(flaps, call, other, "a") is None, call[1]


def test_the_revocation_list_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "revoked-tokens"
    source = RevocationList(path)  # none yet: nothing revoked
    assert source.revoked == frozenset()
    write_private(path, b"0123456789abcdef  # revoked 2025-01-01T00:00:00Z: lost laptop\n")
    assert source.reload()
    assert source.revoked == {"0123456789abcdef"}
    assert not source.reload()  # unchanged
    # A broken file does not un-revoke anything.
    write_private(path, b"0123456789abcdef\nnot-an-id\n")
    assert not source.reload()
    assert source.revoked == {"0123456789abcdef"}
    with pytest.raises(ValueError, match="line 2: 'not-an-id' is not a token id"):
        RevocationList(path)


async def test_only_the_proxy_has_tokens_verified_and_it_gets_their_grant(flaps: Flaps) -> None:
    """The edge holds no root keys: flaps verifies a token for it (flaps.verify), on its
    cluster port, for the proxy's certificate only."""
    token = flaps.mint("apps = a", "ops = read")
    info = inspect_token(token)
    proxy = tokens_pb2_grpc.TokenServiceStub(
        channel(flaps.cluster_address, flaps.security.member_tls("proxy"))
    )
    got = await proxy.VerifyToken(tokens_pb2.VerifyTokenRequest(token=token), timeout=T)
    assert (got.refused, got.token_id) == ("", info.token_id)
    assert list(got.caveats) == list(info.caveats)
    assert got.expires.seconds == int(info.caveats[-1].rpartition(" ")[2])
    for bad, why in [
        (tampered(token), "bad signature"),
        (flaps.mint(f"expires = {int(time.time()) - 1}"), "expired at"),
        ("garbage", "not a nonomad token"),
    ]:
        refused = await proxy.VerifyToken(tokens_pb2.VerifyTokenRequest(token=bad), timeout=T)
        assert why in refused.refused
        assert not refused.token_id, why
    flaps.revoked[0] = frozenset({info.token_id})
    refused = await proxy.VerifyToken(tokens_pb2.VerifyTokenRequest(token=token), timeout=T)
    assert refused.refused == f"token {info.token_id} was revoked"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await proxy.VerifyToken(tokens_pb2.VerifyTokenRequest(token=" "), timeout=T)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token: is required" in (raised.value.details() or "")
    public = tokens_pb2_grpc.TokenServiceStub(
        channel(flaps.address, flaps.security.client_tls(), flaps.mint())
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await public.VerifyToken(tokens_pb2.VerifyTokenRequest(token=token), timeout=T)
    assert raised.value.code() == DENIED
