"""Placement: a pipeline of small named stages, assembled per request (flaps holds no state).

Feasibility has two kinds of stage, and a worker is rejected once, for the first reason:

- index stages, answered for a whole region at once from the replica's `registry.supply.Supply`
  (counts it keeps as rows and heartbeats arrive, never a pass over the region): liveness
  (`dead`, `suspect`, `unknown`), `cordoned`, `missing_label`, `machine_limit`,
  `insufficient_memory`, `insufficient_cpu`, `insufficient_disk`;
- candidate stages (`CANDIDATE_CHECKS`): `standby_conflict`, `app_spread_limit`. They can only
  reject the app's own workers (those holding a primary the standby must avoid, or the app's
  machines), a small set `Supply.holders` names: each of those that fits the index stages is
  judged up front, so what they exclude is known exactly without looking at anyone else.

The workers that fit are drawn uniformly at random, without a scan (seeded by the idempotency
key when there is one, so a retry draws the same way), until `sample_size` of them are
feasible or every feasible one was drawn: the power of d choices keeps a decision's cost flat
as the fleet grows, and at most the sample plus the excluded workers are drawn. If any worker
of the region can take the machine, the decision has a candidate; a refusal's rejections are
exact counts, of which the excluded workers drawn are also named. Ranking stages each add one
named sub-score to the drawn candidates.

One key, one machine: with an idempotency key, the first candidate is the worker the key itself
picks, the first that fits walking the pool's hash ring from the key's point (a few ring
neighbours at a time, by rendezvous weight). Two flaps racing the
same key claim on that same worker first, and the worker holds a key for one machine. The
ranked list is a proposal; the worker's answer to the claim is final.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from flyd.v1 import machine_pb2 as pb
from registry.supply import Fit, Pool, Supplier, Supply, key_point
from registry.view import ALIVE, status_name
from runtime.entropy import SYSTEM

# How many candidates a simulation ranks per region.
SIMULATE_SAMPLE = 64
# A key's own worker is chosen among this many ring neighbours at a time (see Pipeline._home).
HOME_CHOICES = 4


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
    primaries: Mapping[str, str] = field(default_factory=dict)
    """Worker id -> a primary of `standby_for` it holds: where a standby must not go."""

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
    """The outcome for one region: ranked candidates and the rejections, by reason."""

    region: str
    candidates: list[Candidate] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    """Workers drawn and rejected by a candidate stage, and claims refused (named)."""
    counted: Counter[str] = field(default_factory=Counter)
    """Workers rejected and not named, by reason: all those of the index stages, and those
    of the candidate stages that were not drawn."""
    examined: int = 0
    """Workers drawn at random."""
    keyed: str = ""
    """The worker the idempotency key picked (ranked first), if any."""

    def counts(self) -> Counter[str]:
        return self.counted + Counter(r.reason for r in self.rejections)


# --- feasibility: the candidate stages ----------------------------------------------------------

# A stage returns None (feasible) or (reason, detail). A candidate stage may reject only a
# worker named in the request's `primaries` or, when it sets `max_per_worker`, one holding
# machines of its app: those are the workers it is asked about (see `Pipeline.decide`).
Check = Callable[[Supplier, Request], tuple[str, str] | None]


def not_with_primary(w: Supplier, r: Request) -> tuple[str, str] | None:
    """A standby on its primary's worker would die with it: the one thing it must not do."""
    clash = r.primaries.get(w.id)
    return ("standby_conflict", f"holds primary {clash}") if clash else None


def under_app_limit(w: Supplier, r: Request) -> tuple[str, str] | None:
    limit, held = r.placement.max_per_worker, w.apps.get(r.app, 0)
    if limit and held >= limit:
        return "app_spread_limit", f"already has {held} machines of {r.app} (limit {limit})"
    return None


CANDIDATE_CHECKS: list[Check] = [not_with_primary, under_app_limit]


# --- feasibility: the index stages --------------------------------------------------------------


def count_rejections(base: Pool, pool: Pool, fit: Fit) -> Counter[str]:
    """What the index stages reject in a region, by reason, in stage order. `base` is the
    region's pool, `pool` the one of its workers with the required labels, `fit` its open
    workers measured against the guest."""
    counted: Counter[str] = Counter()
    for status, n in base.by_status.items():
        if status != ALIVE and n:
            counted[status_name(status)] += n
    counted["cordoned"] += base.cordoned
    counted["missing_label"] += base.ready - pool.ready
    counted["machine_limit"] += pool.full
    counted["insufficient_memory"] += pool.open - fit.with_memory
    counted["insufficient_cpu"] += fit.with_memory - fit.with_cpu
    counted["insufficient_disk"] += fit.with_cpu - fit.fitting
    return +counted  # without the zeros


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


def score(w: Supplier, r: Request, curve: Curve, weights: Weights) -> Candidate:
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
        subs["spread"] = -weights.spread * w.apps.get(r.app, 0)
    return Candidate(w.id, w.region, round(sum(subs.values()), 6), subs)


# --- the pipeline ----------------------------------------------------------------


def rendezvous(app: str, key: str, worker_id: str) -> bytes:
    """A key's weight for a worker, the same in every process."""
    return hashlib.blake2b(f"{app}\0{key}\0{worker_id}".encode(), digest_size=8).digest()


@dataclass(frozen=True)
class Pipeline:
    """The stages for one request; cheap to build, so built per request."""

    checks: Sequence[Check] = tuple(CANDIDATE_CHECKS)
    curve: Curve = DEFAULT_CURVE
    weights: Weights = Weights()
    sample_size: int = 8
    rng: random.Random = field(default_factory=SYSTEM.rng, compare=False, repr=False)
    """The draws of a request without a seed (a simulated flaps' is seeded: runtime.entropy)."""

    def decide(self, supply: Supply, request: Request, region: str) -> Decision:
        """Rank a random sample of the region's workers that can take the machine."""
        decision = Decision(region)
        base = supply.pool(region)
        pool = supply.pool(region, dict(request.placement.required_labels))
        if base is None or pool is None:
            return decision
        guest = request.guest
        size = (guest.memory_mib, guest.cpu_millicores, guest.disk_mib)
        fit = pool.fit(*size)
        decision.counted = count_rejections(base, pool, fit)
        excluded = self._excluded(supply, pool, request, size)
        feasible_count = fit.fitting - len(excluded)
        home = None
        if request.seed and feasible_count > 0:
            home = self._home(supply, pool, request, size, excluded)
        feasible = [] if home is None else [home]
        decision.keyed = "" if home is None else home.id
        seed = request.seed
        rng = random.Random(f"{request.app}/{seed}") if seed else self.rng
        wanted = min(self.sample_size, feasible_count)
        unnamed = Counter(reason for reason, _ in excluded.values())
        if len(feasible) < wanted:
            for slot in fit.draw(rng):
                worker = supply.at(slot)
                if worker is home:
                    continue
                decision.examined += 1
                rejected = excluded.get(slot)
                if rejected is not None:
                    decision.rejections.append(Rejection(worker.id, *rejected))
                    unnamed[rejected[0]] -= 1
                    continue
                feasible.append(worker)
                if len(feasible) >= wanted:
                    break  # (every feasible worker is drawn before the sample can run dry)
        decision.counted += unnamed
        ranked = [score(w, request, self.curve, self.weights) for w in feasible]
        first = ranked[:1] if home is not None else []
        # Ties keep the (random) drawing order, so equal workers share the load.
        decision.candidates = first + sorted(ranked[len(first) :], key=lambda c: -c.score)
        return decision

    def _excluded(
        self, supply: Supply, pool: Pool, request: Request, size: tuple[int, int, int]
    ) -> dict[int, tuple[str, str]]:
        """The workers that fit the index stages but a candidate stage rejects, by slot, with
        why: of the app's own workers (a primary's, or one holding its machines when the
        request limits them per worker), each judged here. The cost is the app's, not the
        region's."""
        suspects = set(request.primaries)
        if request.placement.max_per_worker:
            suspects.update(supply.holders(request.app))
        out: dict[int, tuple[str, str]] = {}
        for worker_id in suspects:
            worker = supply.supplier(worker_id)
            if worker is None or not pool.fits(worker, *size):
                continue  # (an index stage rejects it, and counted it)
            for check in self.checks:
                rejected = check(worker, request)
                if rejected is not None:
                    out[worker.slot] = rejected
                    break
        return out

    def _home(
        self,
        supply: Supply,
        pool: Pool,
        request: Request,
        size: tuple[int, int, int],
        excluded: Mapping[int, object],
    ) -> Supplier | None:
        """The worker an idempotency key picks: walking the ring from the key's point (a
        bounded walk), the first that passes every stage, the workers taken HOME_CHOICES at
        a time and each handful ordered by rendezvous weight (key, worker): arcs of a ring
        differ in length, and choosing among a few neighbours evens out what each gets."""
        assert request.seed is not None
        app, key = request.app, request.seed
        walk = pool.walk(key_point(app, key))
        while handful := [supply.at(slot) for slot in itertools.islice(walk, HOME_CHOICES)]:
            handful.sort(key=lambda w: rendezvous(app, key, w.id), reverse=True)
            for worker in handful:
                if worker.slot not in excluded and pool.fits(worker, *size):
                    return worker
        return None
