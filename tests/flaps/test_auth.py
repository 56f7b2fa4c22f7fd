"""Who may call flaps for what: every Machines and Platform RPC against every kind of token.

flaps runs in-process as flaps.main wires it (servicers guarded by flaps.auth, then wrapped
by map_error), over TLS with a cluster port, in front of the fake fleet of
tests/flaps/support.py. App `a` has machine A and app `b` machine B. Each request in `CALLS`
is harmless when allowed (an unknown signal, a bad config, destroying a started machine
without force...): what is checked is whether the call got past the token, not what it did.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from pymacaroons import Macaroon

from flaps import auth, placement
from flaps.auth import Authorizer, KeySource
from flaps.errors import map_error
from flaps.service import Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.tokens import InvalidToken, Keyring, attenuate, caveats, new_key_line
from flaps.tokens import inspect as inspect_token
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from nonomad.security import ClusterSecurity
from registry.replica import Replica
from registry.service import serve_replica
from registry.v1 import registry_pb2, registry_pb2_grpc
from runtime import Service, ServiceSettings
from runtime.pki import ClusterCA, ClusterMembers, write_private
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import config
from tests.harness import channel, error_info
from tests.servicers import T, seconds, serving

DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
KEY = new_key_line("k1")
OTHER_KEY = new_key_line("k1")  # same id, another secret: a forged signature
ROTATED = new_key_line("k2")


@dataclass
class Flaps:
    """flaps in-process: its addresses, the fleet behind it, machines A (app a) and B (b)."""

    address: str
    cluster_address: str
    fleet: FakeFleet
    security: ClusterSecurity
    keyring: list[Keyring]  # [the keys flaps verifies with]: a test may rotate them
    a: str = ""
    b: str = ""

    def mint(self, *texts: str, keys: str = KEY) -> str:
        return Keyring.parse(keys).mint(texts)

    def stub(self, cls: Any, token: str | None) -> Any:
        return cls(channel(self.address, self.security.client_tls(), token))


@pytest.fixture
async def flaps(tmp_path: Path, security: ClusterSecurity) -> AsyncIterator[Flaps]:
    async with fake_fleet(tmp_path, {"w1": "ams", "w2": "ams"}) as fleet:
        workers = Workers(fleet.replica)
        exchange = Exchange(fleet.replica, workers, placement.Pipeline())
        keyring = [Keyring.parse(KEY)]
        authorizer = Authorizer(lambda: keyring[0], exchange.app_of, ClusterMembers(security.ca))
        cert = security.cert("flaps")
        service = Service(
            "flaps",
            ServiceSettings(
                tls_cert=cert.cert,
                tls_key=cert.key,
                cluster_ca=security.ca,
                cluster_listen="127.0.0.1:0",
                grace_period=1,
            ),
        )
        for servicer, add, descriptor in (
            (
                MachinesServicer(exchange),
                machines_pb2_grpc.add_MachinesServiceServicer_to_server,
                m.DESCRIPTOR.services_by_name["MachinesService"],
            ),
            (
                PlatformServicer(exchange),
                platform_pb2_grpc.add_PlatformServiceServicer_to_server,
                platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
            ),
        ):
            auth.guard(servicer, descriptor, authorizer)
            service.add(servicer, add, descriptor, map_error)
        # Its own replica, knowing a worker: a Follow call has a snapshot to answer with.
        replica = Replica()
        replica.add_worker(fleet.workers["w1"].worker.info())
        serve_replica(
            service,
            replica,
            [],
            lambda servicer, descriptor: auth.guard(servicer, descriptor, authorizer),
        )
        async with serving(service) as address:
            assert service.cluster_address is not None
            f = Flaps(address, service.cluster_address, fleet, security, keyring)
            admin = f.stub(machines_pb2_grpc.MachinesServiceStub, f.mint())
            for app in ("a", "b"):
                request = m.CreateMachineRequest(app=app, region="ams", config=config())
                made = await admin.CreateMachine(request, timeout=T)
                setattr(f, app, made.machine.id)
                await fleet.seen(made.machine.id)
            yield f
        await workers.close()


# -- the table: every RPC, a harmless request on app a's or app b's machine ----------------------

Call = tuple[str, str, Callable[[str, str], Any]]  # (service, rpc, request(machine id, app))
MACHINES, PLATFORM, REGISTRY = "machines", "platform", "registry"
BAD_SIGNAL = "SIGNOPE"

CALLS: list[Call] = [
    (MACHINES, "CreateMachine", lambda mid, app: m.CreateMachineRequest(
        app=app, region="ams", config=config(memory=-1))),
    (MACHINES, "GetMachine", lambda mid, app: m.GetMachineRequest(machine_id=mid)),
    (MACHINES, "ListMachines", lambda mid, app: m.ListMachinesRequest(app=app)),
    (MACHINES, "UpdateMachine", lambda mid, app: m.UpdateMachineRequest(
        machine_id=mid, config=config(memory=-1))),
    (MACHINES, "StartMachine", lambda mid, app: m.StartMachineRequest(machine_id=mid)),
    (MACHINES, "StopMachine", lambda mid, app: m.StopMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL)),
    (MACHINES, "RestartMachine", lambda mid, app: m.RestartMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL)),
    (MACHINES, "SignalMachine", lambda mid, app: m.SignalMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL)),
    (MACHINES, "DestroyMachine", lambda mid, app: m.DestroyMachineRequest(machine_id=mid)),
    (MACHINES, "WaitMachine", lambda mid, app: m.WaitMachineRequest(
        machine_id=mid, state=pb.MACHINE_STATE_STARTED, timeout=seconds(1))),
    (MACHINES, "AcquireLease", lambda mid, app: m.AcquireLeaseRequest(
        machine_id=mid, ttl=seconds(-1))),
    (MACHINES, "ReleaseLease", lambda mid, app: m.ReleaseLeaseRequest(
        machine_id=mid, nonce="not-the-nonce")),
    (MACHINES, "ListMachineEvents", lambda mid, app: m.ListMachineEventsRequest(machine_id=mid)),
    (MACHINES, "GetMachineLogs", lambda mid, app: m.GetMachineLogsRequest(machine_id=mid)),
    # The primary named is another object the call names: here the machine itself.
    (MACHINES, "SupersedeMachine", lambda mid, app: m.SupersedeMachineRequest(
        machine_id=mid, generation=0, primary=mid)),
    (MACHINES, "GetPlacement", lambda mid, app: m.GetPlacementRequest(machine_id=mid)),
    (PLATFORM, "ListRegions", lambda mid, app: platform_pb2.ListRegionsRequest()),
    (PLATFORM, "ListWorkers", lambda mid, app: platform_pb2.ListWorkersRequest()),
    (PLATFORM, "SimulatePlacement", lambda mid, app: platform_pb2.SimulatePlacementRequest(
        app=app, region="ams", config=config())),
    (PLATFORM, "WatchPlacements", lambda mid, app: platform_pb2.WatchPlacementsRequest()),
    (PLATFORM, "CordonWorker", lambda mid, app: platform_pb2.CordonWorkerRequest(
        worker_id="no-such-worker", cordoned=True)),
]  # fmt: skip
# The registry flaps embeds: for the cluster's parts only (no token gets past).
REGISTRY_CALLS: list[Call] = [
    (REGISTRY, "Announce", lambda mid, app: registry_pb2.AnnounceRequest(
        worker=pb.WorkerInfo(id="Not A Worker"))),
    (REGISTRY, "ListMembers", lambda mid, app: registry_pb2.ListMembersRequest()),
    (REGISTRY, "Follow", lambda mid, app: registry_pb2.FollowRequest()),
    (REGISTRY, "ListSlot", lambda mid, app: registry_pb2.ListSlotRequest(app=app, slot="s")),
]  # fmt: skip
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
"""Every app's decisions: read and regions on every app."""


def test_the_table_covers_every_rpc_and_every_rpc_has_a_rule() -> None:
    served = {
        f"/{d.full_name}/{method.name}"
        for d in (
            m.DESCRIPTOR.services_by_name["MachinesService"],
            platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
        )
        for method in d.methods
    }
    assert {rpc for _, rpc, _ in CALLS} == {name.rsplit("/", 1)[1] for name in served}
    assert set(auth.RULES) == served


STUBS: dict[str, Any] = {
    MACHINES: machines_pb2_grpc.MachinesServiceStub,
    PLATFORM: platform_pb2_grpc.PlatformServiceStub,
    REGISTRY: registry_pb2_grpc.RegistryServiceStub,
}


async def outcome(
    f: Flaps, call: Call, token: str | None, app: str, peer: str | None = None
) -> grpc.aio.AioRpcError | None:
    """Make the call on app `app` (its machine) with `token`, or on flaps' cluster port with
    the cluster certificate `peer`: None if it got past the check, else the error that stopped
    it there (UNAUTHENTICATED or PERMISSION_DENIED)."""
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
]


def with_caveat(token: str, text: str) -> str:
    """Add any caveat, as pymacaroons lets a holder do (flaps.tokens.attenuate checks them)."""
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
        # is filtered), and refuses every create.
        creates = rpc in ("CreateMachine", "SimulatePlacement")
        names_one = rpc not in ("ListMachines", WATCH, *FLEET) and not creates
        assert await denial(flaps, call, one_machine, "a") == (only_a if creates else None), rpc
        on_b = only_a if creates or names_one else None
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


REPLICA = {"Announce", "ListMembers", "Follow", "ListSlot"}
LOOKS = READS | {"ListRegions", "ListWorkers", "WatchPlacements"} | (REPLICA - {"Announce"})
PEERS: list[tuple[str, set[str]]] = [
    # Promotes a standby, starts a stopped machine for a request, stops an idle one, tells an
    # outranked copy (and so may restart one: a stop, then a start); its replica follows
    # flaps' and passes announces on.
    ("proxy", REPLICA | {"StartMachine", "StopMachine", "RestartMachine", "SupersedeMachine"}),
    ("console", LOOKS),
    ("cli", LOOKS),
    ("flyd-w1", REPLICA),  # announces itself, asks a slot's claims
    ("flyd", REPLICA),
    ("registry", REPLICA),
    ("flaps", REPLICA),
    ("intruder", set()),  # signed by the cluster CA, but no part of it
]
"""What each cluster certificate may call on flaps' cluster port; everything else is
PERMISSION_DENIED naming the certificate."""


@pytest.mark.parametrize(("peer", "allowed"), PEERS, ids=[p[0] for p in PEERS])
async def test_each_cluster_certificate_may_call_what_its_part_needs(
    flaps: Flaps, peer: str, allowed: set[str]
) -> None:
    ClusterCA.ensure(flaps.security.ca.parent).issue(peer)  # made once, then reused
    assert auth.peer_ops(peer) or not allowed
    for call in [*CALLS, *REGISTRY_CALLS]:
        rpc = call[1]
        err = await outcome(flaps, call, None, "b", peer=peer)
        if rpc in allowed:
            assert err is None, (peer, rpc, err and err.details())
            continue
        assert err is not None, (peer, rpc)
        assert err.code() == DENIED, (peer, rpc)
        info = error_info(err)
        assert info is not None
        assert (info[0], info[2]["certificate"]) == ("CERTIFICATE_ROLE", peer), (peer, rpc)
        assert f"cluster certificate {peer!r}" in (err.details() or "")


def test_every_registry_rpc_is_one_a_cluster_certificate_may_be_given() -> None:
    registry = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"]
    names = {f"/{registry.full_name}/{method.name}" for method in registry.methods}
    assert set(auth.REGISTRY_OPS) == names
    assert {call[1] for call in REGISTRY_CALLS} == {n.rsplit("/", 1)[1] for n in names}


async def test_the_registry_is_for_the_clusters_parts_only(flaps: Flaps) -> None:
    request = registry_pb2.ListMembersRequest()
    public = registry_pb2_grpc.RegistryServiceStub(
        channel(flaps.address, flaps.security.client_tls(), flaps.mint())
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await public.ListMembers(request, timeout=T)
    assert raised.value.code() == DENIED
    assert "cluster" in (raised.value.details() or "")
    member = registry_pb2_grpc.RegistryServiceStub(
        channel(flaps.cluster_address, flaps.security.member_tls())
    )
    await member.ListMembers(request, timeout=T)
    # A part of the cluster may use the Machines API too, with no token, as far as its role
    # goes (the CLI's certificate reads).
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


def test_only_the_cluster_cas_certificates_make_a_part_of_the_cluster(
    security: ClusterSecurity, tmp_path: Path
) -> None:
    members = ClusterMembers(security.ca)
    proxy = security.cert("proxy").cert.read_bytes()
    stranger = ClusterCA.ensure(tmp_path / "other").issue("proxy").cert.read_bytes()
    assert members.name_of(_Context(proxy)) == "proxy"
    assert members.name_of(_Context(proxy)) == "proxy"  # remembered
    assert members.name_of(_Context(stranger)) is None  # another CA, the same name
    assert members.name_of(_Context(None)) is None


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
