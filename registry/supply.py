"""What each worker can supply, indexed for placement as the replica applies rows and heartbeats.

Placement asks a region two things: which workers can take a guest (a few, at random), and why
the others cannot (counted by reason). `Supply` answers both without a pass over the region.
`registry.view.View` keeps it step by step: a heartbeat that changes a worker's free resources,
liveness or cordon moves that worker in O(log n); a row that appears or goes changes one count.

Per region, and per set of required labels (built on first use), a `Pool` keeps:

- how many of its workers are in each liveness state, cordoned, or full (no machine slot);
- its open workers (alive, not cordoned, a slot free) in a `FitTree`: a Fenwick tree over free
  memory whose nodes hold their workers sorted by free CPU. "Free memory >= m" is a prefix of
  at most log2(memory range) nodes and, in each node, "free CPU >= c" is one bisection: the
  workers that fit both form about twenty sorted ranges of known sizes. Counting them costs
  O(log^2 n); drawing one uniformly at random is one random index into their union;
- its open workers on a hash ring, so that a key names the same first choice in every flaps;
- sums of total and free resources, and how many workers have each free shape (ListRegions).

Memory and CPU are indexed; disk, and what depends on the request (a standby's primary, the
app's machines per worker), is checked on each worker drawn.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

from flyd.v1 import machine_pb2 as pb
from registry.sortedints import SortedInts
from registry.v1 import registry_pb2

__all__ = ["Fit", "FitTree", "Pool", "Resources", "Supplier", "Supply", "key_point"]

ALIVE = registry_pb2.MEMBER_STATUS_ALIVE
UNKNOWN = registry_pb2.MEMBER_STATUS_UNSPECIFIED

# An index entry is one int: (free CPU or ring point) << SLOT_BITS | the worker's slot.
SLOT_BITS = 24
SLOT_MASK = (1 << SLOT_BITS) - 1
# A node is a bare sorted array until it holds this many workers, then a SortedInts (blocks
# of arrays): most nodes of a Fenwick tree hold one or two workers, a few hold most. Arrays
# hold no references, so the garbage collector never walks the index.
BIG_NODE = 1024
# Points per worker on a pool's hash ring, and how many points a key's walk looks at.
RING_POINTS = 4
RING_WALK = 64
# Label sets a region keeps a pool for; the least recently used goes first.
LABEL_POOLS = 32

Node: TypeAlias = "array[int] | SortedInts"


class Resources(NamedTuple):
    cpu_millicores: int = 0
    memory_mib: int = 0
    disk_mib: int = 0
    machines: int = 0

    @classmethod
    def of(cls, r: pb.Resources) -> Resources:
        return cls(int(r.cpu_millicores), int(r.memory_mib), int(r.disk_mib), int(r.machines))


NOTHING = Resources()


@dataclass(eq=False, slots=True)
class Supplier:
    """One worker as placement sees it. Owned by the `Supply`: read it, do not change it."""

    id: str
    slot: int
    ring: tuple[int, ...]
    region: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    status: int = UNKNOWN
    """registry.v1 MemberStatus."""
    cordoned: bool = False
    total: Resources = NOTHING
    free: Resources = NOTHING
    images: frozenset[str] = frozenset()
    """Refs and digests of the images it has cached."""
    apps: dict[str, int] = field(default_factory=dict)
    """Machines (not destroyed) it holds, per app."""

    @property
    def ready(self) -> bool:
        """Alive and not cordoned: it may be asked to take work."""
        return self.status == ALIVE and not self.cordoned

    @property
    def open(self) -> bool:
        """Ready with a machine slot free: in the fit tree and on the ring."""
        return self.ready and self.free.machines >= 1


def _point(text: str) -> int:
    """A 32-bit point on a ring, the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big")


def key_point(app: str, key: str) -> int:
    """Where an idempotency key of an app starts its walk on a pool's ring."""
    return _point(f"{app}\0{key}")


def _insert(nodes: dict[int, Node], i: int, entry: int) -> None:
    node = nodes.get(i)
    if node is None:
        nodes[i] = array("q", [entry])
    elif isinstance(node, SortedInts):
        node.add(entry)
    else:
        bisect.insort(node, entry)
        if len(node) >= BIG_NODE:
            nodes[i] = SortedInts(node)


def _delete(nodes: dict[int, Node], i: int, entry: int) -> None:
    node = nodes[i]
    node.remove(entry)
    if not node:
        del nodes[i]


def _bisect(node: Node, entry: int) -> int:
    if isinstance(node, SortedInts):
        return node.bisect_left(entry)
    return bisect.bisect_left(node, entry)


@dataclass(frozen=True)
class Fit:
    """A pool's open workers measured against one guest size (valid until the pool changes)."""

    with_memory: int
    """Open workers with enough free memory."""
    fitting: int
    """Of those, the ones with enough free CPU too."""
    ranges: tuple[tuple[Node, int, int], ...]
    """(node, first index, count): the fitting workers as sorted ranges."""

    def draw(self, rng: random.Random) -> Iterator[int]:
        """The fitting workers' slots in uniformly random order, each once, lazily: a
        Fisher-Yates shuffle of the union of the ranges that moves only what it visits.
        Consume it before the pool changes."""
        moved: dict[int, int] = {}
        total = self.fitting
        for i in range(total):
            j = rng.randrange(i, total)
            pick = moved.get(j, j)
            moved[j] = moved.get(i, i)
            for node, lo, n in self.ranges:
                if pick < n:
                    yield node[lo + pick] & SLOT_MASK
                    break
                pick -= n


class FitTree:
    """Open workers by free memory and CPU; see the module docstring."""

    def __init__(self) -> None:
        self.bits = 10
        self.nodes: dict[int, Node] = {}
        self._memory: dict[int, int] = {}  # entry -> the free memory it was filed under

    def __len__(self) -> int:
        return len(self._memory)

    def add(self, memory: int, cpu: int, slot: int) -> None:
        memory, entry = max(0, memory), max(0, cpu) << SLOT_BITS | slot
        if memory >> self.bits:
            self._grow(memory)
        self._memory[entry] = memory
        size = 1 << self.bits
        i = size - memory
        while i <= size:
            _insert(self.nodes, i, entry)
            i += i & -i

    def remove(self, memory: int, cpu: int, slot: int) -> None:
        entry = max(0, cpu) << SLOT_BITS | slot
        memory = self._memory.pop(entry)
        size = 1 << self.bits
        i = size - memory
        while i <= size:
            _delete(self.nodes, i, entry)
            i += i & -i

    def _grow(self, memory: int) -> None:
        """Widen the memory range to hold `memory`: re-file every worker (rare: once per
        doubling of the largest worker seen)."""
        filed = self._memory
        self.bits = max(self.bits, memory.bit_length())
        self.nodes, self._memory = {}, {}
        for entry, mem in filed.items():
            self.add(mem, entry >> SLOT_BITS, entry & SLOT_MASK)

    def fit(self, memory: int, cpu: int) -> Fit:
        """The open workers with at least `memory` MiB and `cpu` millicores free."""
        size = 1 << self.bits
        i = size - max(0, memory)
        floor = max(0, cpu) << SLOT_BITS
        with_memory = fitting = 0
        ranges = []
        while i > 0:
            node = self.nodes.get(i)
            if node is not None:
                with_memory += len(node)
                lo = _bisect(node, floor)
                if lo < len(node):
                    ranges.append((node, lo, len(node) - lo))
                    fitting += len(node) - lo
            i -= i & -i
        return Fit(with_memory, fitting, tuple(ranges))


class Pool:
    """The workers of a region (that carry `labels`); see the module docstring."""

    def __init__(self, region: str, labels: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.region = region
        self.labels = labels
        self.workers = 0
        self.by_status: Counter[int] = Counter()
        self.cordoned = 0
        """Alive but cordoned."""
        self.ready = 0
        """Alive and not cordoned."""
        self.full = 0
        """Ready without a machine slot free."""
        self.tree = FitTree()
        self.ring = SortedInts()
        self.total = [0, 0, 0, 0]
        """Sums of the ready workers' total resources (cpu, memory, disk, machines)."""
        self.free = [0, 0, 0, 0]
        """Sums of the ready workers' free resources."""
        self.shapes: Counter[Resources] = Counter()
        """Ready workers by free resources."""

    def holds(self, s: Supplier) -> bool:
        return s.region == self.region and all(s.labels.get(k) == v for k, v in self.labels)

    @property
    def open(self) -> int:
        return len(self.tree)

    def join(self, s: Supplier, sign: int = 1) -> None:
        """Count `s` in (or, with sign -1, out of) every figure and structure."""
        self.workers += sign
        self.by_status[s.status] += sign
        if s.status == ALIVE and s.cordoned:
            self.cordoned += sign
        if not s.ready:
            return
        self.ready += sign
        for i in range(4):
            self.total[i] += sign * s.total[i]
            self.free[i] += sign * s.free[i]
        self.shapes[s.free] += sign
        if not self.shapes[s.free]:
            del self.shapes[s.free]
        if s.free.machines < 1:
            self.full += sign
            return
        if sign > 0:
            self.tree.add(s.free.memory_mib, s.free.cpu_millicores, s.slot)
            for point in s.ring:
                self.ring.add(point << SLOT_BITS | s.slot)
        else:
            self.tree.remove(s.free.memory_mib, s.free.cpu_millicores, s.slot)
            for point in s.ring:
                self.ring.remove(point << SLOT_BITS | s.slot)

    def leave(self, s: Supplier) -> None:
        self.join(s, -1)

    def fit(self, memory: int, cpu: int) -> Fit:
        return self.tree.fit(memory, cpu)

    def walk(self, point: int) -> Iterator[int]:
        """Open workers' slots in ring order from `point`, each once, at most RING_WALK points:
        every flaps with the same view walks the same way."""
        ring = self.ring
        if not ring:
            return
        start = ring.bisect_left(point << SLOT_BITS)
        seen = set()
        for entry in itertools.islice(itertools.chain(ring.islice(start), ring), RING_WALK):
            slot = entry & SLOT_MASK
            if slot not in seen:
                seen.add(slot)
                yield slot


class Supply:
    """Every worker's `Supplier`, and the pools that index them."""

    def __init__(self) -> None:
        self._suppliers: dict[str, Supplier] = {}
        self._slots: list[Supplier | None] = []
        self._free_slots: list[int] = []
        self._regions: dict[str, Pool] = {}
        self._members: dict[str, dict[str, Supplier]] = {}  # region -> its workers
        self._labelled: dict[str, dict[frozenset[tuple[str, str]], Pool]] = {}

    # -- reads -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._suppliers)

    def supplier(self, worker_id: str) -> Supplier | None:
        return self._suppliers.get(worker_id)

    def at(self, slot: int) -> Supplier:
        """The supplier filed under `slot` (from a `Fit` or a ring walk)."""
        s = self._slots[slot]
        assert s is not None, f"slot {slot} is empty"
        return s

    def regions(self) -> Mapping[str, Pool]:
        """Each region's pool (no labels required)."""
        return self._regions

    def members(self, region: str) -> Mapping[str, Supplier]:
        return self._members.get(region, {})

    def pool(self, region: str, labels: Mapping[str, str] | None = None) -> Pool | None:
        """The pool of `region`'s workers that carry every one of `labels`; None for a region
        without workers. A pool for a new label set is built from the region's workers once,
        then kept up to date like the others."""
        base = self._regions.get(region)
        if base is None or not labels:
            return base
        key = frozenset(labels.items())
        pools = self._labelled.setdefault(region, {})
        pool = pools.pop(key, None)
        if pool is None:
            pool = Pool(region, key)
            for s in self._members[region].values():
                if pool.holds(s):
                    pool.join(s)
            if len(pools) >= LABEL_POOLS:
                del pools[next(iter(pools))]
        pools[key] = pool  # last: the most recently used
        return pool

    # -- changes -----------------------------------------------------------------------------

    def update(
        self,
        worker_id: str,
        *,
        region: str,
        labels: Mapping[str, str],
        status: int,
        cordoned: bool = False,
        total: Resources = NOTHING,
        free: Resources = NOTHING,
        images: frozenset[str] = frozenset(),
    ) -> Supplier:
        """Learn of a worker or of what changed about it; O(log n) when it moves."""
        s = self._suppliers.get(worker_id)
        if s is None:
            s = self._new(worker_id)
        elif (s.region, s.status, s.cordoned, s.free, s.total) == (
            region,
            status,
            cordoned,
            free,
            total,
        ) and s.labels == labels:
            s.images = images
            return s
        else:
            self._leave(s)
        s.region, s.labels, s.status, s.cordoned = region, dict(labels), status, cordoned
        s.total, s.free, s.images = total, free, images
        self._join(s)
        return s

    def remove(self, worker_id: str) -> None:
        """Forget a worker (the replica dropped it: dead too long); its slot is reused."""
        s = self._suppliers.pop(worker_id, None)
        if s is None:
            return
        self._leave(s)
        self._slots[s.slot] = None
        self._free_slots.append(s.slot)

    def count(self, worker_id: str, app: str, delta: int) -> None:
        """`delta` more machines (not destroyed) of `app` on the worker."""
        s = self._suppliers[worker_id]
        held = s.apps.get(app, 0) + delta
        if held > 0:
            s.apps[app] = held
        else:
            s.apps.pop(app, None)

    def _new(self, worker_id: str) -> Supplier:
        slot = self._free_slots.pop() if self._free_slots else len(self._slots)
        if slot > SLOT_MASK:
            raise OverflowError(f"more than {SLOT_MASK + 1} workers")
        ring = tuple(_point(f"{worker_id}#{i}") for i in range(RING_POINTS))
        s = Supplier(id=worker_id, slot=slot, ring=ring)
        if slot == len(self._slots):
            self._slots.append(s)
        else:
            self._slots[slot] = s
        self._suppliers[worker_id] = s
        return s

    def _pools_of(self, s: Supplier) -> Iterator[Pool]:
        yield self._regions[s.region]
        for pool in self._labelled.get(s.region, {}).values():
            if pool.holds(s):
                yield pool

    def _join(self, s: Supplier) -> None:
        if s.region not in self._regions:
            self._regions[s.region] = Pool(s.region)
            self._members[s.region] = {}
        self._members[s.region][s.id] = s
        for pool in self._pools_of(s):
            pool.join(s)

    def _leave(self, s: Supplier) -> None:
        for pool in self._pools_of(s):
            pool.leave(s)
        del self._members[s.region][s.id]
        if not self._members[s.region]:
            del self._members[s.region], self._regions[s.region]
            self._labelled.pop(s.region, None)
