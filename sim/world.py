"""Virtual time in one process: every node of a simulated cluster runs on an event loop of its
own, and one scheduler, driven by the seed, decides which node runs next and when time moves.

A node's loop is asyncio's own (`asyncio.BaseEventLoop`: its futures, tasks, timers and
`call_soon` order are the real ones) with three things taken away from the operating system:

- time: `loop.time()` is the world's time plus the node's skew. Nothing waits for it; when no
  node has anything to run, the world jumps to the earliest timer of any node that may run;
- the order: the world runs one ready callback at a time, of a node it draws from the seed
  among those that have one, so two nodes' steps interleave differently from seed to seed
  (within one node, callbacks keep the FIFO order asyncio promises);
- threads: `run_in_executor` (and so `asyncio.to_thread`) runs the call on the loop, as a
  callback of its own, so its moment is drawn like any other's.

A killed node is never stepped again, as a process after SIGKILL: its tasks stay suspended
where they were, no `finally` and no `except CancelledError` of theirs runs while the world
runs. What survives it (its host's disk, its machines) is whatever the caller kept outside the
node. A paused node (SIGSTOP) is not stepped until it resumes; its timers then find time has
jumped. `World.close` ends every node's tasks for good once the run is over, after the sinks a
dead node held were fenced (its disk handles closed), so what its `finally` blocks do then
reaches nothing.

The loop runs no real I/O: sockets and subprocesses raise `SimulationError` (the simulated
network and disk are their own seams).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import hashlib
import heapq
import math
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runtime.entropy import SeededEntropy

T = TypeVar("T")

EPOCH = 1_800_000_000.0
"""The wall-clock time (seconds since 1970) at which every world starts: fixed, so that
timestamps are the same in every run of a seed."""


class SimulationError(Exception):
    """The simulation itself cannot go on: a node asked for real I/O, or a run never settles."""


class Livelock(SimulationError):
    """Nodes kept running callbacks without time ever moving: something spins on the loop."""


class SimLoop(asyncio.BaseEventLoop):
    """One node's event loop, stepped by its `World` one callback at a time.

    It reads and writes BaseEventLoop's own queues (`_ready`, `_scheduled`) as its
    `_run_once` does, one callback where `_run_once` runs them all: what asyncio's tasks,
    futures and timers put there is what the world runs (CPython 3.11's layout).
    """

    _ready: collections.deque[asyncio.Handle]
    _scheduled: list[asyncio.TimerHandle]
    _timer_cancelled_count: int
    _thread_id: int | None

    def __init__(self, world: World, node: str, skew: float = 0.0) -> None:
        super().__init__()
        self.world = world
        self.node = node
        self.skew = skew
        self._clock_resolution = 1e-9  # virtual time is exact: a timer is due at its time
        self._thread_id = threading.get_ident()  # "running", as far as any caller can tell
        self.set_exception_handler(self._on_error)
        self.errors: list[dict[str, Any]] = []

    # -- what asyncio asks of a loop --

    def time(self) -> float:
        return self.world.now + self.skew

    def _process_events(self, event_list: list[Any]) -> None:  # no selector: no events
        pass

    def _write_to_self(self) -> None:  # call_soon_threadsafe: nothing ever blocks to be woken
        pass

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """The call runs on this loop as a callback of its own: no thread, nothing drawn by
        the operating system's scheduler."""
        future: asyncio.Future[T] = self.create_future()

        def call() -> None:
            if future.cancelled():
                return
            try:
                result = func(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as err:  # its awaiter hears of it
                future.set_exception(err)
            else:
                future.set_result(result)

        self.call_soon(call)
        return future

    def _refuse(self, what: str) -> SimulationError:
        return SimulationError(f"node {self.node}: {what} is not simulated on this loop")

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("a real socket connection")

    async def create_server(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("a real listening socket")

    async def subprocess_exec(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("a subprocess")

    async def subprocess_shell(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("a subprocess")

    async def getaddrinfo(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("name resolution")

    def _on_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # Kept, not printed: a live node's unhandled error is a finding of the run (the world
        # reports it); a dead node's pending tasks being dropped at close is what death means.
        self.errors.append(context)

    # -- what the world asks of it --

    def has_ready(self) -> bool:
        return bool(self._ready)

    def next_timer(self) -> float | None:
        """World time of this loop's earliest live timer, or None."""
        scheduled = self._scheduled
        while scheduled and scheduled[0].cancelled():
            self._timer_cancelled_count -= 1
            _unschedule(heapq.heappop(scheduled))
        if not scheduled:
            return None
        when = scheduled[0].when()
        at = when - self.skew
        while at + self.skew < when:  # (the float sum may fall short: the timer stays not due)
            at = math.nextafter(at, math.inf)
        return at

    def wake_due(self) -> None:
        """Move the timers due now to the ready queue, in their order."""
        now = self.time()
        scheduled = self._scheduled
        while scheduled and (scheduled[0].cancelled() or scheduled[0].when() <= now):
            handle = heapq.heappop(scheduled)
            _unschedule(handle)
            if handle.cancelled():
                self._timer_cancelled_count -= 1
            else:
                self._ready.append(handle)

    def step(self) -> None:
        """Run the oldest ready callback, as this node's running loop."""
        handle = self._ready.popleft()
        if handle.cancelled():
            return
        outer = asyncio.events._get_running_loop()  # (a test's own loop, if it has one)
        asyncio.events._set_running_loop(self)
        try:
            handle._run()
        finally:
            asyncio.events._set_running_loop(outer)


def _unschedule(handle: asyncio.TimerHandle) -> None:
    # Off the heap: a later cancel() must not count it as a cancelled timer still there.
    handle._scheduled = False  # type: ignore[attr-defined]


@dataclass
class Node:
    """One simulated process: a name, a loop, and a seeded source of its own."""

    world: World
    name: str
    loop: SimLoop
    entropy: SeededEntropy
    alive: bool = True
    paused_until: float | None = None  # world time; None when not paused
    steps: int = 0
    context: contextvars.Context = field(default_factory=contextvars.Context, repr=False)
    """What every task and callback of the node runs in (a copy each): its transport
    (runtime.transport), and whatever else is the process's."""

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Start `coro` as a task of this node (it first runs when the world steps it)."""
        if not self.alive:
            coro.close()
            raise SimulationError(f"node {self.name} is dead: it runs nothing")
        return self.loop.create_task(coro, name=name, context=self.context.copy())

    def wall(self) -> float:
        """The node's wall clock: seconds since 1970, skew included."""
        return self.clock.now()

    @property
    def clock(self) -> SimClock:
        """The node's `runtime.clock.Clock`: its wall clock, sleeping in virtual time."""
        return SimClock(self.loop.time)


class SimClock:
    """A `runtime.clock.Clock` on virtual time: `now()` is `EPOCH` plus what `time()` reads (a
    node's loop time, skew included; or the world's own, for what outlives nodes), and
    `sleep_until` a timer of the loop that calls it."""

    def __init__(self, time: Callable[[], float]) -> None:
        self._time = time

    def now(self) -> float:
        return EPOCH + self._time()

    async def sleep_until(self, when: float) -> None:
        if (delay := when - self.now()) > 0:
            await asyncio.sleep(delay)


class World:
    """The nodes of one simulated run, the time they share, and the seed that orders them."""

    def __init__(self, seed: int, *, max_steps_without_time: int = 1_000_000) -> None:
        self.seed = seed
        self.entropy = SeededEntropy(seed)
        self.rng = self.entropy.child("world").rng()
        self.now = 0.0  # seconds since the world started; a node's loop.time() adds its skew
        self.nodes: dict[str, Node] = {}
        self.dead: list[Node] = []  # every node ever killed, in order (their loops are kept)
        self.trace: list[tuple[float, str, str]] = []
        self._schedule = hashlib.sha256()  # which node ran each step, and when
        self.max_steps_without_time = max_steps_without_time
        self._generation: dict[str, int] = {}

    @property
    def clock(self) -> SimClock:
        """The world's wall clock, no node's skew: for what outlives nodes (a host's
        machines). It sleeps on whichever node's loop calls it."""
        return SimClock(lambda: self.now)

    # -- nodes --

    def add(self, name: str, skew: float = 0.0) -> Node:
        """A new node (a restart of a killed one is a new node of the same name)."""
        if name in self.nodes:
            raise SimulationError(f"node {name} is already running")
        generation = self._generation.get(name, 0)
        self._generation[name] = generation + 1
        node = Node(
            world=self,
            name=name,
            loop=SimLoop(self, name, skew),
            entropy=self.entropy.child(f"{name}#{generation}"),
        )
        self.nodes[name] = node
        self.record(name, "start" if generation == 0 else f"restart {generation}")
        return node

    def kill(self, name: str) -> Node:
        """SIGKILL: the node is never stepped again; nothing of it runs, not even `finally`."""
        node = self._live(name)
        node.alive = False
        del self.nodes[name]
        self.dead.append(node)
        self.record(name, "killed")
        return node

    def pause(self, name: str, seconds: float) -> None:
        """SIGSTOP now, SIGCONT `seconds` later: its timers then find the time jumped."""
        if seconds <= 0:
            raise ValueError(f"pause: seconds must be > 0, not {seconds}")
        node = self._live(name)
        node.paused_until = max(node.paused_until or 0.0, self.now + seconds)
        self.record(name, f"paused {seconds:.3f}s")

    def deliver(self, name: str, callback: Callable[[], None], delay: float = 0.0) -> bool:
        """Run `callback` on node `name`'s loop `delay` seconds from now: how anything crosses
        from one node to another. False (and nothing runs, ever) when the node is not up."""
        node = self.nodes.get(name)
        if node is None:
            return False
        context = node.context.copy()
        if delay > 0:
            node.loop.call_at(node.loop.time() + delay, callback, context=context)
        else:
            node.loop.call_soon(callback, context=context)
        return True

    def _live(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise SimulationError(f"no live node {name}") from None

    # -- the trace --

    def record(self, node: str, event: str) -> None:
        """Something that happened, for the run's trace (what two runs of a seed compare)."""
        self.trace.append((self.now, node, event))

    def trace_hash(self) -> str:
        """A digest of the trace and of the schedule (which node ran each step, and when)."""
        digest = self._schedule.copy()
        for when, node, event in self.trace:
            digest.update(f"{when!r}\t{node}\t{event}\n".encode())
        return digest.hexdigest()

    # -- running --

    def step(self, until: float | None = None) -> bool:
        """Run one callback of one node; or, when no node has one ready, move time to the
        next timer of a node that may run (not past `until`). False when neither happened:
        nothing is left to do before `until` (or ever)."""
        now = self.now
        ready = []
        for node in self.nodes.values():
            if node.paused_until is not None and node.paused_until <= now:
                node.paused_until = None
                self.record(node.name, "resumed")
            if node.paused_until is None:
                node.loop.wake_due()
                if node.loop.has_ready():
                    ready.append(node)
        if ready:
            node = ready[0] if len(ready) == 1 else self.rng.choice(ready)
            node.steps += 1
            self._schedule.update(f"{node.name}@{now!r};".encode())
            node.loop.step()
            return True
        upcoming = [when for node in self.nodes.values() if (when := self._next_of(node))]
        soonest = min(upcoming, default=None)
        if soonest is None or (until is not None and soonest > until):
            return False
        self.now = max(now, soonest)
        return True

    def _next_of(self, node: Node) -> float | None:
        """World time at which `node` may next run something, or None."""
        timer = node.loop.next_timer()
        if node.paused_until is None:
            return timer
        # Nothing runs before it resumes; what is due by then runs when it does.
        if timer is None and not node.loop.has_ready():
            return None
        return max(node.paused_until, timer or 0.0)

    def run_until(self, when: float, done: Callable[[], bool] = lambda: False) -> None:
        """Step until world time `when` (then stand at it), until nothing is left to do, or
        until `done()` is true after a step."""
        still = 0  # steps in a row without time moving
        while not done():
            before = self.now
            if not self.step(when):
                self.now = max(self.now, when)
                return
            still = still + 1 if self.now == before else 0
            if still > self.max_steps_without_time:
                spinning = sorted(n.name for n in self.nodes.values() if n.loop.has_ready())
                raise Livelock(
                    f"{still} steps at t={self.now:.6f}s without time moving: "
                    f"nodes {', '.join(spinning)} always have work ready"
                )

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    def run(self, node: Node, coro: Coroutine[Any, Any, T], timeout: float = 3600.0) -> T:
        """Run `coro` on `node` (stepping the whole world) until it is done: its result, or
        its error raised here. SimulationError when it is not done `timeout` seconds later,
        or nothing is left that could finish it."""
        name = getattr(coro, "__qualname__", repr(coro))
        task = node.spawn(coro)
        deadline = self.now + timeout
        self.run_until(deadline, lambda: task.done() or self._idle())
        if not task.done():
            why = " (the node was killed)" if not node.alive else ""
            if self.now < deadline and not why:  # it stopped short: nothing left to run
                why = ": nothing left to run can finish it"
            raise SimulationError(f"{name} on {node.name} not done at t={self.now:.3f}s{why}")
        return task.result()

    def _idle(self) -> bool:
        """No node has a callback ready or a timer set: nothing will ever run again."""
        return all(
            not node.loop.has_ready() and node.loop.next_timer() is None
            for node in self.nodes.values()
        )

    @staticmethod
    def _close_task(node: Node, task: asyncio.Task[Any]) -> None:
        coro = task.get_coro()
        outer = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(node.loop)
        try:
            coro.close()
        except RuntimeError:  # a finally that awaited: nothing would resume it
            pass
        finally:
            asyncio.events._set_running_loop(outer)

    def errors(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Unhandled errors that live nodes' loops reported (a task's exception never
        retrieved, a callback that raised)."""
        for node in self.nodes.values():
            for context in node.loop.errors:
                yield node.name, context

    def close(self, settle: float = 60.0) -> None:
        """End every node's tasks for good: the run is over. Every task, the dead nodes' too,
        is cancelled and given `settle` virtual seconds to unwind (a service's shutdown runs
        as on SIGTERM); what is left then is closed where it stands. Call once the sinks the
        dead held are fenced: what they do now is not part of the run."""
        # The dead unwind too, now: their sinks are fenced, and an async generator closed
        # where it stands (rather than cancelled) fails in its `aclosing`.
        everyone = [*self.nodes.values(), *self.dead]
        self.nodes = {f"{node.name}#{i}": node for i, node in enumerate(everyone)}
        for node in everyone:
            node.paused_until = None
            for task in asyncio.all_tasks(node.loop):
                task.cancel()
        deadline = self.now + settle
        with contextlib.suppress(Livelock):
            self.run_until(
                deadline,
                lambda: all(not asyncio.all_tasks(node.loop) for node in everyone),
            )
        for node in everyone:
            node.alive = False
            with warnings.catch_warnings():
                # (a coroutine its close left un-awaited: nothing would ever await it)
                warnings.simplefilter("ignore", RuntimeWarning)
                for task in asyncio.all_tasks(node.loop):
                    self._close_task(node, task)
            node.loop._ready.clear()
            node.loop._scheduled.clear()
            node.loop._thread_id = None  # (a running loop cannot be closed)
            node.loop.close()
            node.loop.errors.clear()
        self.nodes.clear()
        self.dead.clear()
