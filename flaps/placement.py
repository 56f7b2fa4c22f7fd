"""Placement: a pipeline of small named stages, assembled per request (flaps holds no state).

Feasibility stages each reject a worker for one named reason, which is counted, so a refusal
explains itself ("3 insufficient_memory, 1 dead"). Ranking stages each add one named
sub-score. Large regions are not scored whole: workers are visited in random order (seeded by
the idempotency key when there is one, so a retry ranks the same way) and only the first
`sample_size` feasible ones are ranked: the power of d choices keeps decision cost flat as the
fleet grows. The ranked list is a proposal; the worker's answer to the claim is final.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flyd.v1 import machine_pb2 as pb


@dataclass(frozen=True)
class WorkerState:
    """What placement knows of a worker, taken from the registry view."""

    id: str
    region: str
    status: str  # "alive", "suspect" or "dead"
    cordoned: bool
    total: pb.Resources
    free: pb.Resources
    labels: dict[str, str]
    images: frozenset[str]  # refs and digests it has cached
    machine_ids: frozenset[str]  # machines (not destroyed) it holds
    app_machines: Counter[str]  # machines (not destroyed) per app


@dataclass(frozen=True)
class Request:
    """A bid: a machine of this size, for this app, in one of these regions (in order)."""

    app: str
    regions: tuple[str, ...]
    guest: pb.GuestConfig
    image: str
    placement: pb.PlacementConfig
    standby_for: frozenset[str] = frozenset()
    seed: str | None = None  # the idempotency key, for a repeatable order

    @property
    def image_keys(self) -> frozenset[str]:
        """The ways a worker's cache may name this image: the reference, and its digest."""
        _, _, digest = self.image.partition("@")
        return frozenset({self.image, digest} - {""})


@dataclass(frozen=True)
class Rejection:
    worker_id: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    region: str
    score: float
    sub_scores: dict[str, float]


@dataclass
class Decision:
    """The outcome for one region: ranked candidates and every rejection, by reason."""

    region: str
    candidates: list[Candidate] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    examined: int = 0

    def counts(self) -> Counter[str]:
        return Counter(r.reason for r in self.rejections)


# --- feasibility -------------------------------------------------------------

# A stage returns None (feasible) or (reason, detail).
Check = Callable[[WorkerState, Request], tuple[str, str] | None]


def alive(w: WorkerState, r: Request) -> tuple[str, str] | None:
    """Only workers whose heartbeats arrive on time can take work now."""
    if w.status != "alive":
        return w.status, f"worker is {w.status}"
    return None


def not_cordoned(w: WorkerState, r: Request) -> tuple[str, str] | None:
    """A cordoned worker refuses new machines; asking would only waste a round trip."""
    return ("cordoned", "worker is cordoned") if w.cordoned else None


def _fits(resource: str, need: int, free: int, unit: str) -> tuple[str, str] | None:
    if need > free:
        return f"insufficient_{resource}", f"needs {need} {unit}, {free} free"
    return None


def has_cpu(w: WorkerState, r: Request) -> tuple[str, str] | None:
    return _fits("cpu", r.guest.cpu_millicores, w.free.cpu_millicores, "millicores")


def has_memory(w: WorkerState, r: Request) -> tuple[str, str] | None:
    return _fits("memory", r.guest.memory_mib, w.free.memory_mib, "MiB")


def has_disk(w: WorkerState, r: Request) -> tuple[str, str] | None:
    return _fits("disk", r.guest.disk_mib, w.free.disk_mib, "MiB")


def has_machine_slot(w: WorkerState, r: Request) -> tuple[str, str] | None:
    if w.free.machines < 1:
        return "machine_limit", f"holds its most machines ({w.total.machines})"
    return None


def has_labels(w: WorkerState, r: Request) -> tuple[str, str] | None:
    """Required labels are constraints, not preferences."""
    for key, value in r.placement.required_labels.items():
        if w.labels.get(key) != value:
            return "missing_label", f"needs label {key}={value}"
    return None


def not_with_primary(w: WorkerState, r: Request) -> tuple[str, str] | None:
    """A standby on its primary's worker would die with it: the one thing it must not do."""
    clash = r.standby_for & w.machine_ids
    if clash:
        return "standby_conflict", f"holds primary {sorted(clash)[0]}"
    return None


def under_app_limit(w: WorkerState, r: Request) -> tuple[str, str] | None:
    limit, held = r.placement.max_per_worker, w.app_machines[r.app]
    if limit and held >= limit:
        return "app_spread_limit", f"already has {held} machines of {r.app} (limit {limit})"
    return None


FEASIBILITY: list[Check] = [
    alive,
    not_cordoned,
    has_cpu,
    has_memory,
    has_disk,
    has_machine_slot,
    has_labels,
    not_with_primary,
    under_app_limit,
]


# --- ranking -------------------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """A piecewise-linear utility of utilization (0..1) after placement."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        ys = [y for _, y in self.points]
        if len(xs) < 2 or xs[0] != 0 or xs[-1] != 1:
            raise ValueError("curve points must span 0..1: the first x is 0, the last is 1")
        if any(b <= a for a, b in itertools.pairwise(xs)):
            raise ValueError("curve points must be sorted by strictly increasing x")
        if not all(math.isfinite(v) for v in ys):
            raise ValueError("curve values must be finite numbers")

    def __call__(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return self.points[0][1]
        if i >= len(self.points):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1


# Best fit: fuller workers score higher, so large holes stay free for large machines, until
# a worker gets hot; past 85% the utility falls off again.
DEFAULT_CURVE = Curve(((0.0, 0.1), (0.85, 1.0), (1.0, 0.7)))


@dataclass(frozen=True)
class Weights:
    cpu: float = 1.0
    memory: float = 1.0
    image_cached: float = 0.5
    spread: float = 1.0


def _utilization(total: int, free: int, need: int) -> float:
    return 1.0 if total <= 0 else min(1.0, (total - free + need) / total)


def score(w: WorkerState, r: Request, curve: Curve, weights: Weights) -> Candidate:
    subs = {
        "cpu": weights.cpu
        * curve(
            _utilization(w.total.cpu_millicores, w.free.cpu_millicores, r.guest.cpu_millicores)
        ),
        "memory": weights.memory
        * curve(_utilization(w.total.memory_mib, w.free.memory_mib, r.guest.memory_mib)),
        # A cached image starts in milliseconds instead of a pull.
        "image_cached": weights.image_cached if r.image_keys & w.images else 0.0,
    }
    if r.placement.spread:
        subs["spread"] = -weights.spread * w.app_machines[r.app]
    return Candidate(w.id, w.region, round(sum(subs.values()), 6), subs)


# --- the pipeline ----------------------------------------------------------------


@dataclass(frozen=True)
class Pipeline:
    """The stages for one request; cheap to build, so built per request."""

    checks: Sequence[Check] = tuple(FEASIBILITY)
    curve: Curve = DEFAULT_CURVE
    weights: Weights = Weights()
    sample_size: int = 8

    def decide(self, workers: Sequence[WorkerState], request: Request, region: str) -> Decision:
        """Rank a bounded sample of the region's feasible workers; record every rejection."""
        decision = Decision(region)
        pool = [w for w in workers if w.region == region]
        rng = random.Random(f"{request.app}/{request.seed}") if request.seed else random.Random()
        rng.shuffle(pool)
        feasible: list[WorkerState] = []
        for worker in pool:
            if len(feasible) >= self.sample_size:
                break
            decision.examined += 1
            for check in self.checks:
                rejected = check(worker, request)
                if rejected is not None:
                    decision.rejections.append(Rejection(worker.id, *rejected))
                    break
            else:
                feasible.append(worker)
        ranked = [score(w, request, self.curve, self.weights) for w in feasible]
        # Ties keep the (random) visiting order, so equal workers share the load.
        decision.candidates = sorted(ranked, key=lambda c: -c.score)
        return decision
