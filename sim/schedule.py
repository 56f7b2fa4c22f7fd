"""One simulated run of a seed: a cluster, a workload, a nemesis, then the checkers.

The seed draws everything: which fault kinds this run uses at all (swarm testing: a run with
few kinds goes deeper into each), when each fault strikes and for how long, what every client
does, every latency and every sync time. A chaos phase (`chaos` seconds) runs the workload
beside the nemesis; then every fault is healed and every flyd that is down booted again, and
a calm phase (`calm` seconds) lets the cluster settle before the checkers read it.

The workload is the cluster's users: clients that create machines under idempotency keys
drawn from a small pool (so retries and duplicates happen) and retry what failed or timed out
with the same key, as a careful user does; and destroy machines they were told of. Every call
goes into the history with its outcome: ok, fail (a status that says nothing happened) or
unknown (a timeout or an unreachable flaps: it may have happened).

The checkers read the truth from the disks (every flyd is killed at the end, so only what was
synced counts) and compare it with the history and with what the live replicas said.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
import grpc.aio

from flaps.v1 import machines_pb2, machines_pb2_grpc
from flyd import fsm
from flyd.v1 import machine_pb2 as pb
from sim import checks
from sim.checks import Call
from sim.cluster import IMAGE, BootFailed, Cluster, Host
from sim.disk import DiskFaults
from sim.world import SimulationError, World

FAULT_KINDS = ("kill", "partition", "pause", "disk_stall", "disk_eio", "delay", "skew")
# How far a node's clocks may stand from the world's in a run with skew: as NTP keeps hosts,
# near, never at, one another (the design takes them to agree within a fraction of a second).
MAX_SKEW = 0.4

CAPACITY_FLAGS = (
    "--capacity.cpu-millicores=2000",
    "--capacity.memory-mib=1024",
    "--capacity.machines=8",
)
CAPACITY = checks.Capacity(machines=8, memory_mib=1024)
MEMORY_MIB = 256  # four fit a worker by memory
CONFIG = pb.MachineConfig(
    image=IMAGE, guest=pb.GuestConfig(cpu_millicores=100, memory_mib=MEMORY_MIB)
)
# What a status says of a create that failed: nothing was made (ok to forget), or maybe.
NOTHING_MADE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
}


@dataclass
class Report:
    seed: int
    simulated: float = 0.0
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    kinds: tuple[str, ...] = ()
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    trace: str = ""  # the world's trace hash: the same seed gives the same one
    # The faults that struck, by their place in the seed's draw (what `only` names), each
    # as "t=12.345s partition w2 3.210s".
    struck: dict[int, str] = field(default_factory=dict)


@dataclass
class Schedule:
    """The parameters of a run; `run(seed)` plays one."""

    workers: int = 3
    clients: int = 3
    keys: int = 6
    proxies: int = 2
    slots: int = 2  # primaries with a standby each, made once and left to the failovers
    chaos: float = 40.0
    calm: float = 30.0

    def run(
        self, seed: int, root: Path | None = None, *, only: Collection[int] | None = None
    ) -> Report:
        """Play `seed`; with `only`, of the faults it draws just those (their places in the
        draw, `Report.struck`'s keys) strike: the rest of the run is drawn as before."""
        with tempfile.TemporaryDirectory(prefix=f"nonomad-sim-{seed}-") as tmp:
            return _Run(self, seed, Path(root or tmp), only).play()


def shrink(schedule: Schedule, report: Report, *, budget: int = 100) -> tuple[Report, list[int]]:
    """Fewer of a failing run's faults that still break an invariant: drop halves of those
    left, then quarters, and so on (a ddmin), keeping each drop after which the seed still
    fails; at most `budget` runs. The last failing report, and the faults it kept."""
    kept, last, runs = sorted(report.struck), report, 0
    chunk = max(1, len(kept) // 2)
    while kept and runs < budget:
        dropped = False
        for start in range(0, len(kept), chunk):
            if runs >= budget:
                break
            trial = kept[:start] + kept[start + chunk :]
            runs += 1
            tried = schedule.run(report.seed, only=trial)
            if tried.violations:
                kept, last, dropped = trial, tried, True
                break
        if dropped:
            chunk = min(chunk, max(1, len(kept) // 2))
        elif chunk == 1:
            break
        else:
            chunk //= 2
    return last, kept


class _Run:
    def __init__(
        self, schedule: Schedule, seed: int, root: Path, only: Collection[int] | None = None
    ) -> None:
        self.schedule = schedule
        self.world = World(seed)
        self.rng = self.world.entropy.child("schedule").rng()
        # Drawn apart from the faults, whose draws must not depend on what happened (how many
        # flyd boots a run has does): a run of fewer of them draws the same ones.
        self.skews = self.world.entropy.child("skew").rng()
        self.only = None if only is None else frozenset(only)
        self.strikes = 0
        self.report = Report(seed)
        kinds = [k for k in FAULT_KINDS if self.rng.random() < 0.6]
        self.report.kinds = tuple(kinds)
        self.cluster = Cluster(self.world, root)
        self.history: list[Call] = []
        # (app, slot, generation): the members that recorded it (sim.checks.promotions)
        self._promoted: dict[tuple[str, str, int], set[str]] = {}
        self._disk_faults: dict[str, set[str]] = collections.defaultdict(set)

    def play(self) -> Report:
        cluster, world = self.cluster, self.world
        try:
            cluster.boot_flaps(skew=self._skew())
            for i in range(self.schedule.workers):
                cluster.boot_flyd(cluster.add_host(f"w{i + 1}"), *CAPACITY_FLAGS, skew=self._skew())
            for i in range(self.schedule.proxies):
                cluster.boot_proxy(f"proxy-{i + 1}", skew=self._skew())
            cluster.settle(
                lambda: len(cluster.workers_seen()) == self.schedule.workers,
                what="flaps follows every worker",
            )
            user = cluster.user()
            stop = asyncio.Event()
            clients = [
                user.spawn(self._client(i, stop), name=f"client-{i}")
                for i in range(self.schedule.clients)
            ]
            clients.append(user.spawn(self._slots(), name="slots"))
            end = world.now + self.schedule.chaos
            self._nemesis(end)
            world.run_until(end)
            world.run(user, _set(stop))
            self._heal()
            self._calm(self.schedule.calm)
            world.run_until(world.now + 30.0, lambda: all(c.done() for c in clients))
            self._check_live()
            for host in cluster.hosts.values():
                if host.flyd is not None:
                    cluster.kill_flyd(host)
            self._check_durable()
            self.report.simulated = world.now
            self.report.trace = world.trace_hash()
            return self.report
        finally:
            cluster.close()

    # -- the nemesis --

    def _nemesis(self, end: float) -> None:
        """Faults until `end`: each strikes after a drawn wait and lasts a drawn while, and
        they overlap (a kill during a stall of the same disk, a partition during a pause)."""
        world, rng = self.world, self.rng
        agenda: list[tuple[float, int, Callable[[], None]]] = []
        count = itertools.count()
        strike = world.now + rng.expovariate(1 / 2.0)
        while world.now < end:
            upcoming = min(strike, agenda[0][0] if agenda else end, end, world.now + 1.0)
            world.run_until(upcoming)
            self._watch_promotions()
            for host in self._exited():
                restart: Callable[[], None] = partial(self._boot, host)
                heapq.heappush(agenda, (world.now + 1.0, next(count), restart))
            while agenda and agenda[0][0] <= world.now:
                heapq.heappop(agenda)[2]()
            if world.now >= strike and world.now < end:
                undo, lasts = self._strike()
                if undo is not None:
                    heapq.heappush(agenda, (world.now + lasts, next(count), undo))
                strike = world.now + rng.expovariate(1 / 2.0)
        for _, _, undo in sorted(agenda):
            undo()

    def _strike(self) -> tuple[Callable[[], None] | None, float]:
        """One fault of a kind this run uses, now; what ends it, and when. Every draw for it
        is made first, whatever happens next, so that the draws never depend on the run."""
        world, rng, cluster = self.world, self.rng, self.cluster
        if not self.report.kinds:
            return None, 0.0
        kind = rng.choice(self.report.kinds)
        host = rng.choice(list(cluster.hosts.values()))
        lasts = rng.uniform(0.5, 8.0)
        both, slowest = rng.random() < 0.7, rng.uniform(0.1, 2.0)
        place, self.strikes = self.strikes, self.strikes + 1
        if self.only is not None and place not in self.only:
            return None, 0.0
        if kind in ("kill", "partition", "pause", "delay", "skew") and host.flyd is None:
            return None, 0.0
        self.report.faults[kind] += 1
        self.report.struck[place] = f"t={world.now:.3f}s {kind} {host.name} {lasts:.3f}s"
        world.record("nemesis", f"{kind} {host.name} {lasts:.3f}s")
        if kind == "kill":
            cluster.kill_flyd(host)
            return lambda: self._boot(host), lasts
        if kind == "partition":
            assert host.flyd is not None
            node = host.flyd.node.name
            cluster.net.block(node, "flaps-1", both=both)
            return lambda: cluster.net.unblock(node, "flaps-1", both=both), lasts
        if kind == "pause":
            assert host.flyd is not None
            world.pause(host.flyd.node.name, lasts)
            return None, lasts
        if kind == "delay":  # a slow link, in order: late answers, late heartbeats
            assert host.flyd is not None
            node = host.flyd.node.name
            latency = (0.01, slowest)
            cluster.net.slow(node, "flaps-1", latency, both=both)
            return lambda: cluster.net.unslow(node, "flaps-1", latency, both=both), lasts
        if kind == "skew":  # the host's clock steps: its flyd starts again on the new time
            cluster.kill_flyd(host)
            return lambda: self._boot(host), 1.0
        # Disk faults: some stalls outlast a caller's deadline (5 s), so its retry finds the
        # create still there; a stall and EIO may overlap on one disk.
        flag = "stall" if kind == "disk_stall" else "eio"
        self._disk_faults[host.name].add(flag)
        self._apply_disk(host, 2 * lasts)
        return lambda: self._clear_disk(host, flag), 2 * lasts if flag == "stall" else lasts

    def _exited(self) -> list[Host]:
        """The hosts whose flyd exited on its own (a disk error it does not survive, say),
        now cleaned up as its supervisor finds them: to be started again."""
        gone = []
        for host in self.cluster.hosts.values():
            if host.flyd is not None and host.flyd.task.done():
                self.world.record("nemesis", f"flyd on {host.name} exited")
                self.report.faults["exited"] += 1
                self.cluster.kill_flyd(host)
                gone.append(host)
        return gone

    def _calm(self, seconds: float) -> None:
        """Run with no fault, restarting what exits, as a supervisor does."""
        end = self.world.now + seconds
        while self.world.now < end:
            self.world.run_until(min(end, self.world.now + 1.0))
            self._watch_promotions()
            for host in self._exited():
                self.world.run_for(1.0)
                self._boot(host)

    def _boot(self, host: Host, tries: int = 20) -> None:
        """Start flyd on `host` again, as its supervisor does: after a second, until it runs."""
        for _ in range(tries):
            if host.flyd is not None:
                return
            try:
                self.cluster.boot_flyd(host, *CAPACITY_FLAGS, skew=self._skew())
            except BootFailed as err:
                self.world.record("nemesis", f"boot failed: {err}")
                self.report.faults["boot_failed"] += 1
                self.world.run_for(1.0)
        raise SimulationError(f"flyd on {host.name} never started again")

    def _skew(self) -> float:
        """How far a node booted now stands from the world's time: drawn in a run with skew."""
        if "skew" not in self.report.kinds:
            return 0.0
        return self.skews.uniform(-MAX_SKEW, MAX_SKEW)

    def _apply_disk(self, host: Host, stall: float = 8.0) -> None:
        active = self._disk_faults[host.name]
        host.disk.faults = DiskFaults(
            stall_p=0.7 if "stall" in active else 0.0,
            stall=(0.5, max(0.5, stall)),
            eio_p=0.3 if "eio" in active else 0.0,
        )

    def _clear_disk(self, host: Host, flag: str) -> None:
        self._disk_faults[host.name].discard(flag)
        self._apply_disk(host)

    def _heal(self) -> None:
        self.cluster.net.heal()
        for host in self.cluster.hosts.values():
            host.disk.faults = DiskFaults()
            self._boot(host)
        self.world.record("nemesis", "healed")

    # -- the workload --

    async def _client(self, index: int, stop: asyncio.Event) -> None:
        rng = self.world.entropy.child(f"client-{index}").rng()
        flaps = self.cluster.stub(
            machines_pb2_grpc.MachinesServiceStub, self.cluster.flaps["flaps-1"].address
        )
        known: list[str] = []
        while not stop.is_set():
            if known and rng.random() < 0.3:
                await self._destroy(flaps, known.pop(rng.randrange(len(known))))
            else:
                key = f"k{rng.randrange(self.schedule.keys)}"
                made = await self._create(flaps, key)
                if made and made not in known:
                    known.append(made)
            await asyncio.sleep(rng.uniform(0.05, 1.0))

    async def _slots(self) -> None:
        """The stateful users: a primary and a standby for it, for each slot, made once (as
        carefully as any create) and then left to the proxies' failovers."""
        flaps = self.cluster.stub(
            machines_pb2_grpc.MachinesServiceStub, self.cluster.flaps["flaps-1"].address
        )
        for i in range(self.schedule.slots):
            primary = ""
            for _ in range(20):
                if primary := await self._create(flaps, f"slot-{i}"):
                    break
                await asyncio.sleep(1.0)
            for _ in range(20 if primary else 0):
                if await self._create(flaps, f"slot-{i}/standby", standby_for=primary):
                    break
                await asyncio.sleep(1.0)

    async def _create(
        self, flaps: machines_pb2_grpc.MachinesServiceStub, key: str, standby_for: str = ""
    ) -> str:
        """Create under `key`, retrying what may have happened (as a careful user does)."""
        for _attempt in range(5):
            call = self._invoke("create", key)
            request = machines_pb2.CreateMachineRequest(
                app="web",
                region="ams",
                config=CONFIG,
                idempotency_key=key,
                standby_for=[standby_for] if standby_for else [],
            )
            try:
                answer = await flaps.CreateMachine(request, timeout=5.0)
            except grpc.aio.AioRpcError as err:
                self._settle(call, err)
                if call.outcome == "fail":
                    return ""
                await asyncio.sleep(0.5)
                continue
            call.outcome, call.machine_id = "ok", answer.machine.id
            return answer.machine.id
        return ""

    async def _destroy(self, flaps: machines_pb2_grpc.MachinesServiceStub, machine_id: str) -> None:
        call = self._invoke("destroy", "", machine_id)
        try:
            await flaps.DestroyMachine(
                machines_pb2.DestroyMachineRequest(machine_id=machine_id, force=True), timeout=5.0
            )
        except grpc.aio.AioRpcError as err:
            self._settle(call, err)
        else:
            call.outcome = "ok"

    def _invoke(self, op: str, key: str, machine_id: str = "") -> Call:
        call = Call(op, key, self.world.now, machine_id=machine_id)
        self.history.append(call)
        self.report.calls[op] += 1
        return call

    def _settle(self, call: Call, err: grpc.aio.AioRpcError) -> None:
        call.outcome = "fail" if err.code() in NOTHING_MADE else "unknown"
        call.detail = f"{err.code().name}: {err.details()}"

    # -- the checkers --

    def _check_live(self) -> None:
        """After the calm: every worker is up and followed, flaps' replica has their rows as
        they have them, and each slot has one serving member (given a few seconds each)."""
        self._found(checks.liveness(list(self.cluster.hosts), self.cluster.workers_seen()))
        for check in (
            lambda: checks.replica(self._rows(), self._listed()),
            lambda: checks.slots(self._rows()),
        ):
            deadline = self.world.now + 10.0
            while found := check():
                if self.world.now >= deadline:
                    self._found(found)
                    break
                self.world.run_for(0.5)
                self._watch_promotions()

    def _watch_promotions(self) -> None:
        """Every promotion any worker has recorded so far (a member's row claiming the slot
        for itself above generation 0), from the rows of the running workers and the disks of
        the others: at most one member per generation of a slot, ever."""
        rows = self._rows()
        for host in self.cluster.hosts.values():
            if host.name not in rows:
                rows[host.name] = _synced(host)
        self._found(checks.promotions(self._promoted, rows))

    def _rows(self) -> dict[str, dict[str, pb.Machine]]:
        """Each running worker's rows, from the worker itself."""
        return {
            host.name: {mid: row.machine for mid, row in host.flyd.worker.rows.items()}
            for host in self.cluster.hosts.values()
            if host.flyd is not None
        }

    def _listed(self) -> list[pb.Machine]:
        """Every machine flaps lists, destroyed ones too, page by page."""

        async def call() -> list[pb.Machine]:
            flaps = self.cluster.stub(
                machines_pb2_grpc.MachinesServiceStub, self.cluster.flaps["flaps-1"].address
            )
            out: list[pb.Machine] = []
            token = ""
            while True:
                page = await flaps.ListMachines(
                    machines_pb2.ListMachinesRequest(
                        include_destroyed=True, page_size=1000, page_token=token
                    ),
                    timeout=10.0,
                )
                out += page.machines
                if not (token := page.next_page_token):
                    return out

        return self.world.run(self.cluster.user(), call())

    def _check_durable(self) -> None:
        """What every disk holds (every flyd is down: only what was synced), against the
        history."""
        disks = {host.name: _synced(host) for host in self.cluster.hosts.values()}
        self._found(checks.disks(self.history, disks, CAPACITY))

    def _found(self, violations: list[str]) -> None:
        self.report.violations += [f"t={self.world.now:.3f}s {v}" for v in violations]


def _synced(host: Host) -> dict[str, pb.Machine]:
    """The rows the host's disk holds synced (what a crash now would leave), by id."""
    return {mid: fsm.decode_row(raw).machine for mid, raw in host.disk.synced().rows.items()}


async def _set(event: asyncio.Event) -> None:
    event.set()


def describe(report: Report) -> str:
    faults = ", ".join(f"{k} {n}" for k, n in sorted(report.faults.items())) or "none"
    return (
        f"seed {report.seed}: {report.simulated:.0f}s simulated, faults {faults}, "
        f"calls {dict(report.calls)}, {len(report.violations)} violations"
    )
