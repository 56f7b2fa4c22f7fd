"""What each worker can supply, indexed for placement as the replica applies rows and heartbeats.

Placement asks a region two things: which workers can take a guest (a few, at random), and why
the others cannot (counted by reason). `Supply` answers both without a pass over the region.
`registry.view.View` keeps it step by step: a heartbeat that changes a worker's free resources,
liveness or cordon moves that worker in O(log n); a row that appears or goes changes one count.

Per region, and per set of required labels (built on first use), a `Pool` keeps:

- how many of its workers are in each liveness state, cordoned, or full (no machine slot);
- its open workers (alive, not cordoned, a slot free) in a `FitTree`: a Fenwick tree over free
  memory whose nodes are Fenwick trees over free CPU whose nodes hold their workers sorted by
  free disk. "Free memory >= m, CPU >= c, disk >= d" is a prefix of at most log2(memory
  range) nodes, in each a prefix of at most log2(CPU range) nodes, in each one bisection: the
  workers that fit all three form sorted ranges of known sizes. Counting them costs
  O(log^3 n); drawing one uniformly at random is one random index into their union;
- its workers on a hash ring (whatever their state: a worker that closes or opens moves only
  in the tree), so that a key names the same first choice in every flaps;
- sums of total and free resources, and how many workers have each free shape (ListRegions).

What depends on the request beyond its size (a standby's primaries, the app's machines per
worker) rejects only the app's own workers: `Supply.holders` names them, a small set.
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
# Free disk beyond this (MiB: 256 TiB) is filed as this, so an entry stays within 63 bits.
DISK_MAX = (1 << 38) - 1
# Points per worker on a pool's hash ring, and how many points a key's walk looks at. With
# few points the arcs differ a lot in length (4 points: 10 equal workers took 875 to 3,199 of
# 20,000 keys); with 128 a worker's arcs add up to within about a tenth of its share. Points
# move only when a worker joins or leaves a pool (its region or labels change, it is added or
# removed), never with its liveness or free resources. The walk covers as many points as
# sixteen workers hold, so in a small pool it sees every worker.
RING_POINTS = 128
RING_WALK = 16 * RING_POINTS
# Free shapes `Pool.room` adds up one by one before it counts each further worker as one.
ROOM_SHAPES = 128
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
    ring: array[int]
    """Its points on a pool's hash ring (machine ints, not a tuple of int objects)."""
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


def ring_points(worker_id: str) -> array[int]:
    """A worker's RING_POINTS points on a pool's ring, the same in every process: one hash
    drawn out to 4 bytes a point (one call, not one per point)."""
    digest = hashlib.shake_128(worker_id.encode()).digest(4 * RING_POINTS)
    return array("I", (int.from_bytes(digest[i : i + 4], "big") for i in range(0, len(digest), 4)))


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
    if isinstance(node, SortedInts):
        node.remove(entry)
    else:
        # Found by bisection: array.remove compares entry by entry (a node holds up to
        # BIG_NODE of them, and a heartbeat that moves a worker deletes from ~log^2 nodes).
        j = bisect.bisect_left(node, entry)
        if j == len(node) or node[j] != entry:
            raise ValueError(f"{entry} is not in node {i}")
        del node[j]
    if not node:
        del nodes[i]


def _path(i: int, size: int) -> list[int]:
    """The Fenwick nodes an entry at index `i` is filed in (of a tree over 1..size)."""
    out = []
    while i <= size:
        out.append(i)
        i += i & -i
    return out


def _bisect(node: Node, entry: int) -> int:
    if isinstance(node, SortedInts):
        return node.bisect_left(entry)
    return bisect.bisect_left(node, entry)


@dataclass(frozen=True)
class Fit:
    """A pool's open workers measured against one guest size (valid until the pool changes)."""

    with_memory: int
    """Open workers with enough free memory."""
    with_cpu: int
    """Of those, the ones with enough free CPU too."""
    fitting: int
    """Of those, the ones with enough free disk too: the workers that fit."""
    ranges: tuple[tuple[Node, int, int], ...]
    """(node, first index, count): the fitting workers as sorted ranges."""

    def draw(self, rng: random.Random) -> Iterator[int]:
        """The fitting workers' slots in uniformly random order, each once, lazily: a
        Fisher-Yates shuffle of the union of the ranges that moves only what it visits.
        Consume it before the pool changes."""
        ends = list(itertools.accumulate(n for _, _, n in self.ranges))
        moved: dict[int, int] = {}
        total = self.fitting
        for i in range(total):
            j = rng.randrange(i, total)
            pick = moved.get(j, j)
            moved[j] = moved.get(i, i)
            k = bisect.bisect_right(ends, pick)
            node, lo, n = self.ranges[k]
            yield node[lo + pick - ends[k] + n] & SLOT_MASK


class FitTree:
    """Open workers by free memory, CPU and disk; see the module docstring."""

    def __init__(self) -> None:
        self.memory_bits = 10
        self.cpu_bits = 10
        # memory index -> (CPU index -> entries (disk << SLOT_BITS | slot), sorted)
        self.nodes: dict[int, dict[int, Node]] = {}
        self.sizes: dict[int, int] = {}
        """memory index -> how many workers its node holds."""
        self._filed: dict[int, tuple[int, int, int]] = {}  # slot -> (memory, cpu, disk)

    def __len__(self) -> int:
        return len(self._filed)

    def __contains__(self, slot: int) -> bool:
        return slot in self._filed

    def add(self, memory: int, cpu: int, disk: int, slot: int) -> None:
        memory, cpu, disk = max(0, memory), max(0, cpu), min(max(0, disk), DISK_MAX)
        if memory >> self.memory_bits or cpu >> self.cpu_bits:
            self._grow(memory, cpu)
        self._filed[slot] = (memory, cpu, disk)
        self._file(memory, cpu, disk << SLOT_BITS | slot, 1)

    def remove(self, slot: int) -> None:
        memory, cpu, disk = self._filed.pop(slot)
        self._file(memory, cpu, disk << SLOT_BITS | slot, -1)

    def place(self, memory: int, cpu: int, disk: int, slot: int) -> None:
        """File `slot` at these free resources, moving it if it is filed: a move leaves alone
        the nodes on both its old and its new path (a machine placed or gone moves a worker a
        little, and the paths of nearby indices soon meet), about a third of them."""
        old = self._filed.get(slot)
        memory, cpu, disk = max(0, memory), max(0, cpu), min(max(0, disk), DISK_MAX)
        if old == (memory, cpu, disk):
            return
        if old is None or old[2] != disk or memory >> self.memory_bits or cpu >> self.cpu_bits:
            if old is not None:
                self.remove(slot)
            self.add(memory, cpu, disk, slot)
            return
        entry = disk << SLOT_BITS | slot
        msize, csize = 1 << self.memory_bits, 1 << self.cpu_bits
        old_m, new_m = _path(msize - old[0], msize), _path(msize - memory, msize)
        old_c, new_c = _path(csize - old[1], csize), _path(csize - cpu, csize)
        both_m = set(old_m).intersection(new_m)
        both_c = set(old_c).intersection(new_c)
        gone_c = [j for j in old_c if j not in both_c]
        come_c = [j for j in new_c if j not in both_c]
        nodes, sizes = self.nodes, self.sizes
        for i in old_m:
            inner = nodes[i]
            for j in gone_c if i in both_m else old_c:
                _delete(inner, j, entry)
            if i not in both_m:
                sizes[i] -= 1
                if not sizes[i]:
                    del sizes[i], nodes[i]
        for i in new_m:
            into = nodes.get(i)
            if into is None:
                into = nodes[i] = {}
            for j in come_c if i in both_m else new_c:
                _insert(into, j, entry)
            if i not in both_m:
                sizes[i] = sizes.get(i, 0) + 1
        self._filed[slot] = (memory, cpu, disk)

    def _file(self, memory: int, cpu: int, entry: int, sign: int) -> None:
        msize, csize = 1 << self.memory_bits, 1 << self.cpu_bits
        i = msize - memory
        while i <= msize:
            inner = self.nodes.get(i)
            if inner is None:
                inner = self.nodes[i] = {}
            j = csize - cpu
            while j <= csize:
                if sign > 0:
                    _insert(inner, j, entry)
                else:
                    _delete(inner, j, entry)
                j += j & -j
            size = self.sizes.get(i, 0) + sign
            if size:
                self.sizes[i] = size
            else:
                del self.sizes[i], self.nodes[i]
            i += i & -i

    def _grow(self, memory: int, cpu: int) -> None:
        """Widen the ranges to hold `memory` and `cpu`: re-file every worker (rare: once per
        doubling of the largest worker seen)."""
        filed = self._filed
        self.memory_bits = max(self.memory_bits, memory.bit_length())
        self.cpu_bits = max(self.cpu_bits, cpu.bit_length())
        self.nodes, self.sizes, self._filed = {}, {}, {}
        for slot, (mem, c, d) in filed.items():
            self.add(mem, c, d, slot)

    def fit(self, memory: int, cpu: int, disk: int = 0) -> Fit:
        """The open workers with at least `memory` MiB, `cpu` millicores and `disk` MiB free."""
        msize, csize = 1 << self.memory_bits, 1 << self.cpu_bits
        memory, cpu = max(0, memory), max(0, cpu)  # (beyond the range: no prefix, none fit)
        floor = min(max(0, disk), DISK_MAX + 1) << SLOT_BITS
        with_memory = with_cpu = fitting = 0
        ranges = []
        i = msize - memory
        while i > 0:
            inner = self.nodes.get(i)
            if inner is not None:
                with_memory += self.sizes[i]
                j = csize - cpu
                while j > 0:
                    node = inner.get(j)
                    if node is not None:
                        n = len(node)
                        with_cpu += n
                        lo = _bisect(node, floor) if floor else 0
                        if lo < n:
                            ranges.append((node, lo, n - lo))
                            fitting += n - lo
                    j -= j & -j
            i -= i & -i
        return Fit(with_memory, with_cpu, fitting, tuple(ranges))


def _room(free: Resources, memory: int, cpu: int, disk: int) -> int:
    """How many machines of this size fit in `free`."""
    limits = [free.machines]
    sizes = ((cpu, free.cpu_millicores), (memory, free.memory_mib), (disk, free.disk_mib))
    for need, have in sizes:
        if need > 0:
            limits.append(have // need)
    return max(0, min(limits))


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

    def join(self, s: Supplier, sign: int = 1, *, ring: bool = True, tree: bool = True) -> None:
        """Count `s` in (or, with sign -1, out of) every figure and structure; its ring
        points too unless `ring` is False (it stays in the pool: only its state moved); the
        fit tree too unless `tree` is False (`refile` files it after the change)."""
        self.workers += sign
        if ring:
            change = self.ring.add if sign > 0 else self.ring.remove
            for point in s.ring:
                change(point << SLOT_BITS | s.slot)
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
        if not tree:
            return
        free = s.free
        if sign > 0:
            self.tree.add(free.memory_mib, free.cpu_millicores, free.disk_mib, s.slot)
        else:
            self.tree.remove(s.slot)

    def leave(self, s: Supplier, *, ring: bool = True, tree: bool = True) -> None:
        self.join(s, -1, ring=ring, tree=tree)

    def refile(self, s: Supplier) -> None:
        """File `s` in the fit tree as it is now (it is there exactly when it is open), after
        a `leave` and a `join` that left the tree alone: a move, not a removal and an add."""
        if s.open:
            free = s.free
            self.tree.place(free.memory_mib, free.cpu_millicores, free.disk_mib, s.slot)
        elif s.slot in self.tree:
            self.tree.remove(s.slot)

    def fit(self, memory: int, cpu: int, disk: int = 0) -> Fit:
        return self.tree.fit(memory, cpu, disk)

    def room(self, memory: int, cpu: int, disk: int) -> int:
        """How many machines of this size fit on the pool's open workers, summed (ListRegions'
        `fits`): one term per distinct free shape for the first ROOM_SHAPES shapes, and each
        worker beyond those that fits (the fit tree counts them) as one. Exact while the pool
        has at most ROOM_SHAPES free shapes, a lower bound past that; never a pass over it."""
        fitting = self.fit(memory, cpu, disk).fitting
        total = counted = 0
        for shape, n in itertools.islice(self.shapes.items(), ROOM_SHAPES):
            each = _room(shape, memory, cpu, disk)
            if each:
                total += n * each
                counted += n
        return total + fitting - counted

    def fits(self, s: Supplier, memory: int, cpu: int, disk: int) -> bool:
        """Whether `s` is one of the open workers that `fit(memory, cpu, disk)` counts."""
        free = s.free
        return (
            s.slot in self.tree
            and self.holds(s)
            and free.memory_mib >= memory
            and free.cpu_millicores >= cpu
            and min(free.disk_mib, DISK_MAX) >= min(disk, DISK_MAX + 1)
        )

    def walk(self, point: int) -> Iterator[int]:
        """Open workers' slots in ring order from `point`, each once, within RING_WALK points
        (of any worker of the pool): every flaps with the same view walks the same way."""
        ring = self.ring
        if not ring:
            return
        start = ring.bisect_left(point << SLOT_BITS)
        seen = set()
        for entry in itertools.islice(itertools.chain(ring.islice(start), ring), RING_WALK):
            slot = entry & SLOT_MASK
            if slot not in seen and slot in self.tree:
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
        self._holders: dict[str, dict[str, int]] = {}  # app -> worker id -> its machines

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

    def holders(self, app: str) -> Mapping[str, int]:
        """The workers holding machines (not destroyed) of `app`, with how many: the only
        workers a per-app stage (spread, a standby's primary) can reject."""
        return self._holders.get(app, {})

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
            # In the same pools before and after: its ring points stay where they are.
            rejoin = s.region == region and s.labels == labels
            self._leave(s, rejoin=rejoin)
            s.region, s.labels, s.status, s.cordoned = region, dict(labels), status, cordoned
            s.total, s.free, s.images = total, free, images
            self._join(s, rejoin=rejoin)
            return s
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
        for app in s.apps:
            self._count_holder(app, worker_id, 0)
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
        self._count_holder(app, worker_id, held)

    def _count_holder(self, app: str, worker_id: str, held: int) -> None:
        holders = self._holders.get(app)
        if held > 0:
            if holders is None:
                holders = self._holders[app] = {}
            holders[worker_id] = held
        elif holders is not None:
            holders.pop(worker_id, None)
            if not holders:
                del self._holders[app]

    def _new(self, worker_id: str) -> Supplier:
        slot = self._free_slots.pop() if self._free_slots else len(self._slots)
        if slot > SLOT_MASK:
            raise OverflowError(f"more than {SLOT_MASK + 1} workers")
        ring = ring_points(worker_id)
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

    def _join(self, s: Supplier, *, rejoin: bool = False) -> None:
        if s.region not in self._regions:
            self._regions[s.region] = Pool(s.region)
            self._members[s.region] = {}
        self._members[s.region][s.id] = s
        for pool in self._pools_of(s):
            pool.join(s, ring=not rejoin, tree=not rejoin)
            if rejoin:
                pool.refile(s)

    def _leave(self, s: Supplier, *, rejoin: bool = False) -> None:
        """Count `s` out of its pools; `rejoin`: it joins the same pools again at once (so its
        ring points and its region's pool stay, and it moves in their fit trees)."""
        for pool in self._pools_of(s):
            pool.leave(s, ring=not rejoin, tree=not rejoin)
        del self._members[s.region][s.id]
        if not rejoin and not self._members[s.region]:
            del self._members[s.region], self._regions[s.region]
            self._labelled.pop(s.region, None)
