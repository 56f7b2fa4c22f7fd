"""The router over fakes on a ManualClock: choosing, limits, scale from zero, autostop,
worker death and failover. No test sleeps: time moves when the test says so."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
from typing import Any

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from proxy import router as router_module
from proxy.control import FlapsFailed, NetProbes, autostop_victims, standby_candidates
from proxy.errors import NoBackend, UnknownApp
from proxy.routes import Route, UnknownWorker
from proxy.settings import ProxySettings
from registry.replica import LIVENESS_TICK
from registry.view import ALIVE, DEAD, SUSPECT
from tests.proxy.support import (
    STARTED,
    STOPPED,
    FakeRegistry,
    World,
    fleet,
    http_check,
    machine,
    settle,
    world,
)

S = pb.MachineState


async def spread(w: World, app: str, n: int) -> Counter[str]:
    """Acquire n times without releasing; how many went to each machine."""
    got: Counter[str] = Counter()
    for _ in range(n):
        got[(await w.router.acquire(app)).machine_id] += 1
    return got


# -- choosing ---------------------------------------------------------------------------------


async def test_own_region_is_preferred_and_load_is_spread_by_two_choices() -> None:
    registry = fleet(
        machine("a1", worker="w1"),
        machine("a2", worker="w2"),
        machine("s", worker="s1", region="syd"),
    )
    async with world(registry) as w:
        got = await spread(w, "web", 40)
        # Only ams machines, and least-outstanding of two keeps them within one of each other.
        assert set(got) == {"a1", "a2"}
        assert abs(got["a1"] - got["a2"]) <= 1

        # The region has nothing left that can serve: the request crosses to syd.
        w.router.drain("w1")
        w.router.drain("w2")
        assert (await w.router.acquire("web")).machine_id == "s"


async def test_the_least_loaded_of_two_wins() -> None:
    async with world(fleet(machine("busy", worker="w1"), machine("idle", worker="w2"))) as w:
        held = [await w.router.acquire("web", pinned="busy") for _ in range(3)]
        for _ in range(3):
            assert (await w.router.acquire("web")).machine_id == "idle"
        for backend in held:
            w.router.release(backend, ok=True)
        [(_, routes)] = w.router.routes("web")
        assert [r.in_flight for r in routes] == [0, 3]


async def test_over_the_soft_limit_others_are_preferred_and_one_more_is_started() -> None:
    registry = fleet(
        machine("a", worker="w1", soft=1),
        machine("s", worker="s1", region="syd", soft=1),
        machine("c", worker="w2", state=STOPPED, soft=1),
    )
    async with world(registry) as w:
        assert (await w.router.acquire("web")).machine_id == "a"
        # a is at its soft limit: syd's machine under its limit beats staying local.
        assert (await w.router.acquire("web")).machine_id == "s"
        assert w.flaps.starts == []
        # Everything is past its soft limit: still served, and c is started in the background.
        assert (await w.router.acquire("web")).machine_id in {"a", "s"}
        await settle()
        assert w.flaps.starts == ["c"]
        assert w.stats.cold_starts == 0  # nobody waited for it
        assert (await w.router.acquire("web")).machine_id == "c"


async def test_at_the_hard_limit_a_request_waits_briefly_for_a_slot() -> None:
    async with world(fleet(machine("a", hard=1)), queue_wait=2.0) as w:
        held = await w.router.acquire("web")
        waiting = asyncio.create_task(w.router.acquire("web"))
        await w.advance(1.0)
        assert not waiting.done()
        w.router.release(held, ok=True)  # a slot frees up: the waiter takes it
        await settle()
        assert (await waiting).machine_id == "a"

        # Nobody releases: after queue_wait the request is refused with the reason.
        waiting = asyncio.create_task(w.router.acquire("web"))
        await w.advance(2.0, steps=4)
        with pytest.raises(NoBackend, match="hard limit"):
            await waiting


async def test_pinned_asks_for_one_machine() -> None:
    async with world(fleet(machine("a", worker="w1"), machine("b", worker="w2"))) as w:
        for _ in range(3):
            assert (await w.router.acquire("web", pinned="b")).machine_id == "b"
        with pytest.raises(NoBackend, match="no machine nope"):
            await w.router.acquire("web", pinned="nope")


async def test_excluded_machines_are_skipped() -> None:
    async with world(fleet(machine("a", worker="w1"), machine("b", worker="w2"))) as w:
        assert (await w.router.acquire("web", exclude=frozenset({"a"}))).machine_id == "b"
        with pytest.raises(NoBackend, match="2 already tried"):
            await w.router.acquire("web", exclude=frozenset({"a", "b"}))


async def test_try_acquire_answers_only_when_nothing_needs_waiting() -> None:
    async with world(
        fleet(machine("a", worker="w1"), machine("b", worker="w2", state=STOPPED))
    ) as w:
        got = w.router.try_acquire("web", pinned="a")
        assert got is not None
        assert got.machine_id == "a"
        w.router.release(got, ok=True)
        assert w.router.try_acquire("nope") is None  # acquire raises UnknownApp instead
        assert w.router.try_acquire("web", pinned="b") is None  # it would have to start b


async def test_a_refused_connection_benches_the_machine_for_a_while() -> None:
    async with world(fleet(machine("a", worker="w1"), machine("b", worker="w2"))) as w:
        backend = await w.router.acquire("web", pinned="a")
        w.router.release(backend, ok=False, connect_failed=True)
        assert set(await spread(w, "web", 5)) == {"b"}
        await w.advance(2.0)
        assert "a" in await spread(w, "web", 10)


@pytest.mark.parametrize(
    ("rows", "error", "reason"),
    [
        ((), UnknownApp, "no app named 'web'"),
        # Machines without services are not routed to: the app is not known to the edge.
        ((machine("x", services=False),), UnknownApp, "no app named 'web'"),
        (
            (machine("x", state=STOPPED, autostart=False),),
            NoBackend,
            r"no machine of app web can serve \(1 stopped without autostart\)",
        ),
        (
            (machine("x", state=S.MACHINE_STATE_FAILED),),
            NoBackend,
            r"\(1 failed\)",
        ),
        (
            (machine("sb", state=STOPPED, standbys=["p"]),),
            NoBackend,
            r"\(1 stopped standby\)",
        ),
    ],
)
async def test_unknown_app_and_nothing_to_serve_are_told_apart(
    rows: tuple[pb.Machine, ...], error: type[Exception], reason: str
) -> None:
    async with world(fleet(*rows)) as w:
        with pytest.raises(error, match=reason):
            await w.router.acquire("web")


async def test_a_destroyed_app_becomes_unknown() -> None:
    async with world(fleet(machine("a"))) as w:
        await w.router.acquire("web")
        w.registry.set_state("a", S.MACHINE_STATE_DESTROYED)
        await settle()
        with pytest.raises(UnknownApp):
            await w.router.acquire("web")


# -- scale from zero --------------------------------------------------------------------------


async def test_concurrent_cold_requests_share_one_start() -> None:
    registry = fleet(
        machine("b", worker="w2", state=STOPPED),
        machine("a", worker="w1", state=S.MACHINE_STATE_CREATED),
    )
    async with world(registry) as w:
        w.flaps.gate.clear()  # the start takes a while
        waiting = [asyncio.create_task(w.router.acquire("web")) for _ in range(5)]
        await settle()
        assert w.flaps.starts == ["a"]  # own region, then the lowest id
        assert not any(t.done() for t in waiting)
        w.flaps.gate.set()
        await settle()
        got = await asyncio.gather(*waiting)
        assert {b.machine_id for b in got} == {"a"}
        assert w.flaps.starts == ["a"]
        assert w.stats.cold_starts == 1


async def test_a_cold_request_waits_until_the_port_accepts() -> None:
    async with world(fleet(machine("a", state=STOPPED, port=21001))) as w:
        w.probes.refusing.add(21001)  # the app is still booting
        waiting = asyncio.create_task(w.router.acquire("web"))
        await w.advance(0.2, steps=10)
        assert not waiting.done()
        w.probes.refusing.clear()
        await w.advance(0.2, steps=2)
        assert (await waiting).machine_id == "a"


async def test_a_machine_that_never_comes_up_is_a_503_after_the_cold_start_timeout() -> None:
    async with world(fleet(machine("a", state=STOPPED, port=21002)), cold_start_timeout=10) as w:
        w.probes.refusing.add(21002)
        waiting = asyncio.create_task(w.router.acquire("web"))
        await w.advance(10.0, steps=20)
        with pytest.raises(NoBackend, match=r"\(1 never became ready\)"):
            await waiting


async def test_a_failed_start_is_a_503_with_flaps_reason() -> None:
    async with world(fleet(machine("a", state=STOPPED))) as w:
        w.flaps.fail["a"] = FlapsFailed("could not start machine a: RESOURCE_EXHAUSTED: no room")
        with pytest.raises(NoBackend, match=r"starting one failed: .*no room"):
            await w.router.acquire("web")
        assert w.stats.cold_starts == 0


# -- health ------------------------------------------------------------------------------------


async def test_only_machines_passing_their_checks_get_traffic() -> None:
    registry = fleet(
        machine("a", worker="w1", port=21010, checks=[http_check(interval=5)]),
        machine("b", worker="w2", port=21011, checks=[http_check(interval=5)]),
    )
    async with world(registry) as w:
        assert set(await spread(w, "web", 6)) == {"a", "b"}
        w.probes.failing_http.add(21010)
        await w.advance(5.0)
        assert set(await spread(w, "web", 6)) == {"b"}
        [route] = [r for _, rs in w.router.routes("web") for r in rs if r.machine_id == "a"]
        assert not route.healthy
        w.probes.failing_http.clear()
        await w.advance(5.0)
        assert "a" in await spread(w, "web", 10)


# -- autostop ------------------------------------------------------------------------------------


async def test_idle_machines_stop_but_never_below_min_machines_running() -> None:
    rows = [machine(f"m{i}", worker="w1", autostop=True, min_running=1) for i in range(3)]
    rows.append(machine("keep", worker="w2", autostop=False))
    registry = fleet(*rows, machine("other", app="api", worker="w2", autostop=True))
    async with world(registry, idle_timeout=60, autostop_interval=1) as w:
        busy = await w.router.acquire("web", pinned="m0")
        await w.advance(59.0, steps=59)
        assert w.flaps.stops == []
        await w.advance(2.0, steps=2)
        # web: 4 started, floor 1 -> 3 may stop, but m0 is busy and keep has no autostop.
        assert sorted(w.flaps.stops) == ["m1", "m2", "other"]
        w.router.release(busy, ok=True)
        await w.advance(61.0, steps=61)
        # m0 is idle now too, and web still has 2 started (m0, keep) against a floor of 1.
        assert sorted(w.flaps.stops) == ["m0", "m1", "m2", "other"]


def test_autostop_victims_counts_the_apps_started_machines() -> None:
    routes = [Route(machine=machine(f"m{i}", autostop=True, min_running=2)) for i in range(3)]
    routes[2].last_active = 50.0
    victims = autostop_victims(routes, now=100.0, idle_timeout=30.0, usable=lambda _: True)
    assert [r.id for r in victims] == ["m0"]  # 3 started, floor 2: only the longest idle


# -- worker death and failover --------------------------------------------------------------------


def primary_and_standbys() -> FakeRegistry:
    return fleet(
        machine("p", worker="w1"),
        machine("sb-2", worker="w3", state=STOPPED, standbys=["p"]),
        machine("sb-1", worker="w2", state=STOPPED, standbys=["p"]),
        machine("sb-0", worker="w1", state=STOPPED, standbys=["p"]),  # same worker: useless
        workers={"w1": "ams", "w2": "ams", "w3": "ams"},
    )


async def test_a_dead_worker_is_routed_around_and_one_standby_is_started() -> None:
    async with world(primary_and_standbys()) as w:
        assert (await w.router.acquire("web")).machine_id == "p"
        w.probes.dead_workers.add("w1.test:7000")
        w.registry.set_status("w1", SUSPECT)  # heartbeats stopped
        await settle()
        assert w.probes.worker_probes == ["w1.test:7000"]
        assert w.router.is_dead("w1")
        assert w.flaps.starts == ["sb-1"]  # the lowest id on another, alive worker
        assert w.stats.failovers == 1
        # The next request goes to the standby (which warms up first), never to p.
        assert (await w.router.acquire("web")).machine_id == "sb-1"
        # The registry later says dead too: nothing more happens.
        w.registry.set_status("w1", DEAD)
        await w.advance(1.0)
        assert w.flaps.starts == ["sb-1"]


async def test_the_data_plane_hears_of_the_machines_lost_with_a_dead_worker() -> None:
    async with world(primary_and_standbys()) as w:
        heard: list[tuple[frozenset[str], str, bool]] = []

        def lost(machines: frozenset[str], reason: str) -> None:
            # By now a request sent again must not be routed to the lost machines.
            heard.append((machines, reason, w.router.try_acquire("web") is None))

        w.router.on_machines_lost(lost)
        w.flaps.gate.clear()  # the standby's start is under way, not done
        w.probes.dead_workers.add("w1.test:7000")
        w.registry.set_status("w1", SUSPECT)
        await settle()
        assert heard == [
            (
                frozenset({"p", "sb-0"}),
                "its worker w1 was declared dead (heartbeats stopped and the probe failed)",
                True,
            )
        ]
        w.flaps.gate.set()
        w.router.declare_dead("w1", "again")  # once per death
        assert len(heard) == 1


async def test_every_proxy_that_notices_picks_the_same_standby() -> None:
    registry = primary_and_standbys()
    async with world(registry, seed=1) as a, world(registry, a.flaps, seed=2) as b:
        for x in (a, b):
            x.probes.dead_workers.add("w1.test:7000")
        a.flaps.gate.clear()  # both ask before either start shows in the registry
        registry.set_status("w1", SUSPECT)
        await settle()
        assert a.router.is_dead("w1")
        assert b.router.is_dead("w1")
        assert a.flaps.starts == ["sb-1", "sb-1"]
        a.flaps.gate.set()  # StartMachine is idempotent: one standby runs
        await settle()
        assert a.flaps.started == {"sb-1"}
        assert registry.machine("sb-2").state == STOPPED  # type: ignore[union-attr]
        assert (await b.router.acquire("web")).machine_id == "sb-1"


async def test_a_worker_back_within_the_window_triggers_nothing() -> None:
    async with world(primary_and_standbys(), probe_interval=0.5) as w:
        w.registry.set_status("w1", SUSPECT)  # a hiccup: heartbeats late, but it answers
        await settle()
        assert w.probes.worker_probes == ["w1.test:7000"]
        await w.advance(0.5)
        assert len(w.probes.worker_probes) == 2  # still silent: probed again
        w.registry.set_status("w1", ALIVE)
        await w.advance(2.0, steps=4)
        assert len(w.probes.worker_probes) == 2
        assert not w.router.is_dead("w1")
        assert w.flaps.starts == []
        assert w.stats.failovers == 0
        assert (await w.router.acquire("web")).machine_id == "p"


async def test_a_worker_back_later_gets_traffic_once_its_machines_pass_checks() -> None:
    registry = fleet(machine("p", worker="w1", port=21020), machine("q", worker="w2", port=21021))
    async with world(registry) as w:
        w.probes.dead_workers.add("w1.test:7000")
        w.registry.set_status("w1", DEAD)
        await settle()
        assert set(await spread(w, "web", 4)) == {"q"}
        w.probes.refusing.add(21020)  # p's port does not answer (yet)
        w.registry.set_status("w1", ALIVE)
        await settle()
        assert not w.router.is_dead("w1")
        assert set(await spread(w, "web", 4)) == {"q"}
        w.probes.refusing.clear()
        await w.advance(0.2, steps=4)
        assert "p" in await spread(w, "web", 10)


def test_standby_candidates_skip_the_primarys_worker_and_dead_workers() -> None:
    primary = machine("p", worker="w1")
    rows = [
        machine("c", worker="w3", state=STOPPED, standbys=["p"]),
        machine("b", worker="w1", state=STOPPED, standbys=["p"]),
        machine("a", worker="dead", state=STOPPED, standbys=["p"]),
        machine("d", worker="w2", state=STOPPED, standbys=["other"]),
    ]
    assert standby_candidates(primary, rows, lambda w: w != "dead") == (None, ["c"])
    rows.append(machine("e", worker="w2", state=STARTED, standbys=["p"]))
    assert standby_candidates(primary, rows, lambda w: w != "dead") == ("e", ["c"])


# -- admin ---------------------------------------------------------------------------------------


async def test_drain_stops_and_resumes_routing_to_a_worker() -> None:
    async with world(fleet(machine("a", worker="w1"), machine("b", worker="w2"))) as w:
        assert w.router.drain("w1") is True
        assert set(await spread(w, "web", 4)) == {"b"}
        [(_, routes)] = w.router.routes("web")
        assert [(r.machine_id, r.draining, r.in_flight) for r in routes] == [
            ("a", True, 0),
            ("b", False, 4),
        ]
        assert w.router.drain("w1", False) is False
        assert "a" in await spread(w, "web", 10)
        with pytest.raises(UnknownWorker, match="worker nope not found"):
            w.router.drain("nope")


async def test_a_resync_rebuilds_the_table() -> None:
    async with world(fleet(machine("a"))) as w:
        w.registry._machines.clear()  # rows vanished while the router was not looking
        w.registry.put(machine("b", app="api"))
        w.registry.resync()
        await settle()
        assert [app for app, _ in w.router.routes()] == ["api"]


async def test_a_router_far_behind_reads_only_what_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thousands of events while the router reads none: it is not resynced from the whole
    view, it reads the latest of each machine (one event each), and ends where the view is."""
    async with world(fleet(machine("a"), machine("b"), machine("c", app="api"))) as w:
        resyncs: list[None] = []
        monkeypatch.setattr(w.router, "_resync", lambda: resyncs.append(None))
        for i in range(5_001):  # no await: the router reads nothing meanwhile
            w.registry.set_state("a", STOPPED if i % 2 else STARTED)
        w.registry.drop("b")
        await settle()
        assert resyncs == []
        assert [
            (app, [(r.machine_id, r.state) for r in routes]) for app, routes in w.router.routes()
        ] == [("api", [("c", STARTED)]), ("web", [("a", STARTED)])]


async def test_an_autostop_pass_looks_only_at_the_apps_of_machines_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Machines are looked at once they could have been idle for idle_timeout, not every pass:
    between two such moments a pass costs nothing, however many machines there are."""
    looked_at: list[int] = []

    def counting(routes: Iterable[Route], **kwargs: Any) -> list[Route]:
        routes = list(routes)
        looked_at.append(len(routes))
        return autostop_victims(routes, **kwargs)

    monkeypatch.setattr(router_module, "autostop_victims", counting)
    busy = [machine(f"web{i}") for i in range(50)]  # no autostop: never stopped
    async with world(fleet(*busy, machine("a", app="api", autostop=True)), idle_timeout=30) as w:
        await w.advance(31.0, steps=31)
        assert w.flaps.stops == ["a"]
        assert max(looked_at) == 51  # the first time each could have been idle: all of them
        looked_at.clear()
        await w.advance(25.0, steps=25)  # none is due again before 30 s more
        assert looked_at == [0] * len(looked_at)
        assert len(looked_at) >= 20


async def test_an_autostopped_app_scales_from_zero_again() -> None:
    async with world(fleet(machine("a", autostop=True)), idle_timeout=30) as w:
        await w.advance(31.0, steps=31)
        assert w.flaps.stops == ["a"]
        assert w.registry.machine("a").state == STOPPED  # type: ignore[union-attr]
        assert (await w.router.acquire("web")).machine_id == "a"
        assert w.flaps.starts == ["a"]
        assert w.stats.cold_starts == 1


async def test_a_standby_that_cannot_start_is_passed_over_for_the_next() -> None:
    async with world(primary_and_standbys()) as w:
        w.flaps.fail["sb-1"] = FlapsFailed(
            "could not start machine sb-1: FAILED_PRECONDITION: destroyed",
            code=grpc.StatusCode.FAILED_PRECONDITION,
        )
        w.probes.dead_workers.add("w1.test:7000")
        w.registry.set_status("w1", SUSPECT)
        await settle()
        assert w.flaps.starts == ["sb-1", "sb-2"]
        assert w.flaps.started == {"sb-2"}
        assert w.stats.failovers == 1


def test_the_default_detection_window_is_under_a_second() -> None:
    settings = ProxySettings()
    assert settings.suspect_after + LIVENESS_TICK + settings.probe_timeout <= 1.0
    assert settings.router_config().probe_timeout == settings.probe_timeout


async def test_net_probes_against_real_sockets() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        status = b"204" if b" /ok " in line else b"503"
        writer.write(b"HTTP/1.1 " + status + b" X\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probes = NetProbes()
    try:
        assert await probes.tcp("127.0.0.1", port, 1.0)
        assert await probes.http("127.0.0.1", port, "/ok", "GET", 1.0)
        assert not await probes.http("127.0.0.1", port, "/bad", "GET", 1.0)
    finally:
        server.close()
        await server.wait_closed()
    assert not await probes.tcp("127.0.0.1", port, 1.0)
    assert not await probes.http("127.0.0.1", port, "/ok", "GET", 1.0)
    assert not await probes.worker(f"127.0.0.1:{port}", 0.3)
