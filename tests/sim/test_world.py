"""The simulated world: virtual time, one callback at a time in an order drawn from the seed,
kill without `finally`, pause with time jumped, no threads and no real I/O."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from sim.world import EPOCH, Livelock, Node, SimulationError, World


@pytest.fixture
def world() -> Iterator[World]:
    world = World(seed=7)
    yield world
    world.close()


async def ticks(node: Node, every: float, count: int) -> int:
    for i in range(count):
        await asyncio.sleep(every)
        node.world.record(node.name, f"tick {i} at {asyncio.get_running_loop().time():.3f}")
    return count


def events(world: World, node: str) -> list[tuple[float, str]]:
    return [(when, event) for when, name, event in world.trace if name == node]


def test_an_hour_of_timers_runs_without_waiting_for_it(world: World) -> None:
    node = world.add("a")
    assert world.run(node, ticks(node, 60.0, 60)) == 60
    assert world.now == 3600.0
    assert events(world, "a")[-1] == (3600.0, "tick 59 at 3600.000")
    assert node.wall() == EPOCH + 3600.0
    assert node.clock.now() == node.wall()


def test_a_skewed_node_reads_its_own_clock_and_its_timers_fire_in_world_time(
    world: World,
) -> None:
    fast, slow = world.add("fast", skew=2.5), world.add("slow", skew=-1.0)
    fast.spawn(ticks(fast, 1.0, 2))
    world.run(slow, ticks(slow, 1.0, 2))
    world.run_for(1.0)
    assert events(world, "fast")[1:] == [(1.0, "tick 0 at 3.500"), (2.0, "tick 1 at 4.500")]
    assert events(world, "slow")[1:] == [(1.0, "tick 0 at 0.000"), (2.0, "tick 1 at 1.000")]
    assert fast.clock.now() - slow.clock.now() == 3.5


@pytest.mark.parametrize("skew", [0.1, -0.3, 0.123456789, 1e-9])
def test_a_node_whose_skew_the_floats_cannot_add_exactly_still_wakes(
    world: World, skew: float
) -> None:
    # World time plus skew may fall a hair short of the timer's own time: the world must
    # still move to a time at which the node sees its timer due, not spin on the one before.
    node = world.add("skewed", skew=skew)

    async def naps() -> int:
        for _ in range(50):
            await asyncio.sleep(0.1)
        return 50

    assert world.run(node, naps()) == 50
    assert world.now == pytest.approx(5.0)


async def chatter(node: Node, rounds: int) -> None:
    for i in range(rounds):
        node.world.record(node.name, f"step {i}")
        await asyncio.sleep(0)


def interleaving(seed: int) -> tuple[list[str], str]:
    world = World(seed)
    try:
        a, b = world.add("a"), world.add("b")
        a.spawn(chatter(a, 30))
        b.spawn(chatter(b, 30))
        world.run_for(1.0)
        return [name for _, name, event in world.trace if event.startswith("step")], (
            world.trace_hash()
        )
    finally:
        world.close()


def test_the_seed_draws_the_order_of_the_nodes_steps_and_the_same_seed_draws_it_again() -> None:
    order, digest = interleaving(1)
    assert interleaving(1) == (order, digest)
    assert order.count("a") == order.count("b") == 30
    others = {tuple(interleaving(seed)[0]) for seed in range(2, 8)}
    assert len(others | {tuple(order)}) > 1, "every seed drew the same interleaving"
    # Not one node's steps and then the other's: they interleave.
    assert order != sorted(order)


def test_a_killed_node_runs_nothing_more_not_even_its_finally(world: World) -> None:
    node = world.add("flyd")

    async def serve() -> None:
        try:
            await asyncio.sleep(10.0)
            world.record("flyd", "woke")
        finally:
            world.record("flyd", "finally")

    node.spawn(serve())
    world.run_for(1.0)
    world.kill("flyd")
    world.run_for(20.0)
    assert [event for _, event in events(world, "flyd")] == ["start", "killed"]
    with pytest.raises(SimulationError, match="dead"):
        node.spawn(serve())
    assert world.deliver("flyd", lambda: world.record("flyd", "delivered")) is False
    # A restart is a new node of the same name, with a stream of draws of its own.
    again = world.add("flyd")
    assert again is not node
    assert again.entropy.seed != node.entropy.seed
    world.run(again, asyncio.sleep(1.0))
    assert events(world, "flyd")[-1] == (21.0, "restart 1")


def test_a_paused_node_resumes_to_find_time_jumped(world: World) -> None:
    node = world.add("flyd")
    node.spawn(ticks(node, 1.0, 5))
    world.run_until(2.5)
    world.pause("flyd", 10.0)
    world.run_until(30.0)
    assert events(world, "flyd") == [
        (0.0, "start"),
        (1.0, "tick 0 at 1.000"),
        (2.0, "tick 1 at 2.000"),
        (2.5, "paused 10.000s"),
        (12.5, "resumed"),
        (12.5, "tick 2 at 12.500"),  # due at 3.0: it runs when the node does
        (13.5, "tick 3 at 13.500"),
        (14.5, "tick 4 at 14.500"),
    ]
    assert world.now == 30.0
    with pytest.raises(ValueError, match="seconds must be > 0"):
        world.pause("flyd", 0)


def test_a_message_crosses_to_another_node_on_that_nodes_loop_after_its_delay(
    world: World,
) -> None:
    a, b = world.add("a"), world.add("b")
    seen: list[tuple[float, asyncio.AbstractEventLoop]] = []

    async def send() -> None:
        world.deliver("b", lambda: seen.append((world.now, asyncio.get_running_loop())), 0.25)

    world.run(a, send())
    world.run_for(1.0)
    assert seen == [(0.25, b.loop)]


def test_threads_are_not_used_a_call_to_a_thread_runs_on_the_loop(world: World) -> None:
    node = world.add("a")
    here = threading.get_ident()

    async def off_loop() -> int:
        return await asyncio.to_thread(threading.get_ident)

    assert world.run(node, off_loop()) == here

    async def failing() -> None:
        await asyncio.get_running_loop().run_in_executor(None, int, "x")

    with pytest.raises(ValueError, match="invalid literal"):
        world.run(node, failing())


@pytest.mark.parametrize(
    "io",
    [
        lambda: asyncio.open_connection("127.0.0.1", 9),
        lambda: asyncio.start_server(lambda r, w: None, "127.0.0.1", 0),
        lambda: asyncio.create_subprocess_exec("true"),
    ],
    ids=["connect", "listen", "subprocess"],
)
def test_real_io_is_refused_naming_the_node(world: World, io) -> None:  # type: ignore[no-untyped-def]
    node = world.add("proxy-1")

    async def attempt() -> None:
        await io()

    with pytest.raises(SimulationError, match=r"node proxy-1: .* not simulated"):
        world.run(node, attempt())


def test_a_node_that_spins_without_letting_time_move_is_named() -> None:
    world = World(seed=1, max_steps_without_time=1000)
    try:
        node = world.add("spinner")
        world.add("idle").spawn(asyncio.sleep(5.0))

        async def spin() -> None:
            while True:  # noqa: ASYNC110 - spinning is what it is for
                await asyncio.sleep(0)

        node.spawn(spin())
        with pytest.raises(Livelock, match="nodes spinner always have work ready"):
            world.run_for(1.0)
    finally:
        world.close()


def test_a_run_that_cannot_finish_says_what_and_where(world: World) -> None:
    node = world.add("flaps")

    async def forever() -> None:
        await asyncio.Event().wait()

    with pytest.raises(
        SimulationError, match=r"forever on flaps not done at t=0\.000s: nothing left"
    ):
        world.run(node, forever())
    with pytest.raises(SimulationError, match=r"sleep on flaps not done at t=5\.000s"):
        world.run(node, asyncio.sleep(60.0), timeout=5.0)
    assert world.now == 5.0


def test_a_callback_that_raises_is_an_error_of_the_run_not_a_crash_of_the_world(
    world: World,
) -> None:
    node = world.add("proxy")
    node.loop.call_soon(lambda: 1 / 0)
    world.run_for(1.0)
    [(name, context)] = list(world.errors())
    assert name == "proxy"
    assert isinstance(context["exception"], ZeroDivisionError)


def test_close_ends_every_task_of_the_living_and_the_dead() -> None:
    world = World(seed=3)
    finished: list[str] = []
    for name in ("a", "b"):
        node = world.add(name)

        async def hold(name: str = name) -> None:
            try:
                await asyncio.sleep(100.0)
            finally:
                finished.append(name)

        node.spawn(hold())
    world.run_for(1.0)
    world.kill("a")
    world.run_for(1.0)
    assert finished == []  # the dead one's finally did not run while the world ran
    world.close()
    assert sorted(finished) == ["a", "b"]
    assert not world.nodes
