"""Placement as tables: each feasibility stage, the utility curve, the scorers, the pipeline.

All pure: workers are filed by hand into a `registry.supply.Supply` with `worker(...)`, no
registry and no network. The properties (against an exhaustive reference) are in
test_placement_properties.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

from flaps import placement
from flaps.placement import (
    CANDIDATE_CHECKS,
    DEFAULT_CURVE,
    Candidate,
    Curve,
    Decision,
    Pipeline,
    Request,
    Weights,
    score,
)
from registry import supply as supply_module
from registry.supply import Resources, Supplier
from registry.view import ALIVE
from tests.flaps.placement_support import IMAGE, REGION, Worker, request, supply_of, worker

DIGEST = "sha256:" + "ab" * 32


def apps(**counts: int) -> dict[str, str]:
    """Machines (id -> app) for a worker: `apps(web=2)` is two machines of app web."""
    return {f"{app}-{i}": app for app, n in counts.items() for i in range(n)}


def supplier(w: Worker) -> Supplier:
    s = supply_of([w]).supplier(w.id)
    assert s is not None
    return s


def decide(workers: Iterable[Worker], r: Request, region: str = REGION, **kw: Any) -> Decision:
    return Pipeline(**kw).decide(supply_of(workers), r, region)


def fleet(n: int, *, prefix: str = "w", **kw: Any) -> list[Worker]:
    return [worker(f"{prefix}{i}", **kw) for i in range(n)]


# --- feasibility ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("w", "r", "reason", "detail"),
    [
        pytest.param(worker(), request(), None, (), id="healthy"),
        pytest.param(worker(status="dead"), request(), "dead", ("dead",), id="dead"),
        pytest.param(worker(status="suspect"), request(), "suspect", ("suspect",), id="suspect"),
        pytest.param(worker(cordoned=True), request(), "cordoned", ("cordoned",), id="cordoned"),
        pytest.param(
            worker(cpu=4000, used_cpu=3001),
            request(cpu=1000),
            "insufficient_cpu",
            ("1000", "999", "millicores"),
            id="cpu-short-by-one",
        ),
        pytest.param(
            worker(cpu=4000, used_cpu=3000),
            request(cpu=1000),
            None,
            (),
            id="cpu-exact-fit",
        ),
        pytest.param(
            worker(memory=2048, used_memory=1025),
            request(memory=1024),
            "insufficient_memory",
            ("1024", "1023", "MiB"),
            id="memory-short-by-one",
        ),
        pytest.param(
            worker(memory=2048, used_memory=1024),
            request(memory=1024),
            None,
            (),
            id="memory-exact-fit",
        ),
        pytest.param(
            worker(disk=1000, used_disk=500),
            request(disk=501),
            "insufficient_disk",
            ("501", "500", "MiB"),
            id="disk-short-by-one",
        ),
        pytest.param(
            worker(disk=1000, used_disk=500),
            request(disk=500),
            None,
            (),
            id="disk-exact-fit",
        ),
        pytest.param(
            worker(disk=1000, used_disk=1000),
            request(disk=0),
            None,
            (),
            id="no-disk-needed",
        ),
        pytest.param(
            worker(slots=4, used_slots=4),
            request(),
            "machine_limit",
            ("machines",),
            id="no-machine-slot",
        ),
        pytest.param(worker(slots=4, used_slots=3), request(), None, (), id="last-machine-slot"),
        pytest.param(
            worker(),
            request(labels={"gpu": "a100"}),
            "missing_label",
            ("gpu=a100",),
            id="label-absent",
        ),
        pytest.param(
            worker(labels={"gpu": "h100"}),
            request(labels={"gpu": "a100"}),
            "missing_label",
            ("gpu=a100",),
            id="label-wrong-value",
        ),
        pytest.param(
            worker(labels={"gpu": "a100", "disk": "nvme"}),
            request(labels={"gpu": "a100"}),
            None,
            (),
            id="label-present",
        ),
        pytest.param(
            worker(machines={"m-primary": "web"}),
            request(standby_for={"m-primary": "w1"}),
            "standby_conflict",
            ("m-primary",),
            id="standby-on-its-primary",
        ),
        pytest.param(
            worker(machines={"m-other": "web"}),
            request(standby_for={"m-primary": "w9"}),
            None,
            (),
            id="standby-elsewhere",
        ),
        pytest.param(
            worker(machines=apps(web=2)),
            request(max_per_worker=2),
            "app_spread_limit",
            ("2", "web"),
            id="app-at-limit",
        ),
        pytest.param(
            worker(machines=apps(web=5)),
            request(max_per_worker=2),
            "app_spread_limit",
            ("5", "limit 2", "web"),
            id="app-over-limit",
        ),
        pytest.param(
            worker(machines=apps(web=1)),
            request(max_per_worker=2),
            None,
            (),
            id="app-under-limit",
        ),
        pytest.param(
            worker(machines=apps(db=5)),
            request(max_per_worker=2),
            None,
            (),
            id="other-app-does-not-count",
        ),
        pytest.param(
            worker(machines=apps(web=50)),
            request(max_per_worker=0),
            None,
            (),
            id="no-app-limit",
        ),
    ],
)
def test_feasibility_stage(
    w: Worker, r: Request, reason: str | None, detail: tuple[str, ...]
) -> None:
    decision = decide([w], r)
    if reason is None:
        assert decision.counts() == Counter()
        assert [c.worker_id for c in decision.candidates] == [w.id]
        return
    assert decision.candidates == []
    assert decision.counts() == Counter({reason: 1})
    if decision.rejections:  # a candidate stage names the worker and says why
        [rejection] = decision.rejections
        assert rejection.worker_id == w.id
        for fragment in detail:
            assert fragment in rejection.detail


def test_a_worker_is_rejected_once_for_its_first_reason() -> None:
    # dead, cordoned and out of memory: only "dead" is counted.
    w = worker(status="dead", cordoned=True, memory=512)
    assert decide([w], request(memory=1024)).counts() == Counter({"dead": 1})


# --- the curve -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        pytest.param(0.0, 0.1, id="first-point"),
        pytest.param(0.85, 1.0, id="peak"),
        pytest.param(1.0, 0.7, id="last-point"),
        pytest.param(0.425, 0.55, id="halfway-up"),
        pytest.param(0.925, 0.85, id="halfway-down"),
        pytest.param(-0.5, 0.1, id="below-0-clamps"),
        pytest.param(1.5, 0.7, id="above-1-clamps"),
    ],
)
def test_default_curve(x: float, expected: float) -> None:
    assert DEFAULT_CURVE(x) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("points", "x", "expected"),
    [
        pytest.param(((0.0, 0.0), (1.0, 1.0)), 0.3, 0.3, id="identity"),
        pytest.param(((0.0, 1.0), (1.0, 0.0)), 0.25, 0.75, id="worst-fit"),
        pytest.param(((0.0, 2.0), (0.5, 2.0), (1.0, 4.0)), 0.75, 3.0, id="flat-then-rising"),
    ],
)
def test_custom_curve(points: tuple[tuple[float, float], ...], x: float, expected: float) -> None:
    assert Curve(points)(x) == pytest.approx(expected)


@pytest.mark.parametrize(
    "points",
    [
        pytest.param(((0.0, 0.0), (1.0, 1.0), (0.5, 0.5)), id="unsorted"),
        pytest.param(((0.1, 0.0), (1.0, 1.0)), id="starts-above-0"),
        pytest.param(((0.0, 0.0), (0.9, 1.0)), id="ends-below-1"),
        pytest.param(((0.0, 0.0),), id="one-point"),
        pytest.param((), id="no-points"),
        pytest.param(((-1.0, 5.0), (2.0, 5.0)), id="wider-than-0..1"),
        pytest.param(((0.0, 0.0), (0.5, 1.0), (0.5, 0.2), (1.0, 1.0)), id="repeated-x"),
        pytest.param(((0.0, float("nan")), (1.0, 1.0)), id="nan"),
    ],
)
def test_invalid_curve(points: tuple[tuple[float, float], ...]) -> None:
    with pytest.raises(ValueError, match="curve"):
        Curve(points)


# --- scoring -------------------------------------------------------------------------------

# 10,000 units of each, so "used" reads as a utilization; the request adds 1,000 (0.1).
NEED = request(cpu=1000, memory=1000)


def big(id: str, **kw: Any) -> Supplier:
    return supplier(worker(id, cpu=10_000, memory=10_000, **kw))


def util(used: int, **kw: Any) -> Supplier:
    return big(f"used{used}", used_cpu=used, used_memory=used, **kw)


def best(*workers: Supplier, r: Request = NEED) -> str:
    ranked = sorted(
        (score(w, r, DEFAULT_CURVE, Weights()) for w in workers), key=lambda c: -c.score
    )
    assert ranked[0].score > ranked[1].score, "a tie proves nothing here"
    return ranked[0].worker_id


@pytest.mark.parametrize(
    ("used", "expected"),
    [
        pytest.param(0, 0.1 + 0.9 * 0.1 / 0.85, id="empty"),
        pytest.param(4000, 0.1 + 0.9 * 0.5 / 0.85, id="half"),
        pytest.param(7500, 1.0, id="lands-on-peak"),
        pytest.param(8500, 0.7 + 0.3 * 0.05 / 0.15, id="past-peak"),
        pytest.param(9000, 0.7, id="full"),
        pytest.param(9500, 0.7, id="overcommitted-clamps-to-full"),
    ],
)
def test_resource_sub_scores_follow_the_curve(used: int, expected: float) -> None:
    subs = score(util(used), NEED, DEFAULT_CURVE, Weights()).sub_scores
    assert subs["cpu"] == pytest.approx(expected)
    assert subs["memory"] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("a", "b", "winner"),
    [
        pytest.param(2000, 6000, "used6000", id="fuller-below-peak-wins"),
        pytest.param(0, 7500, "used7500", id="peak-beats-empty"),
        pytest.param(7500, 8500, "used7500", id="going-past-peak-loses"),
        pytest.param(5000, 9000, "used5000", id="full-loses-to-moderate"),
    ],
)
def test_best_fit(a: int, b: int, winner: str) -> None:
    assert best(util(a), util(b)) == winner


def test_memory_counts_as_much_as_cpu() -> None:
    cpu_hot = big("cpu-hot", used_cpu=6000)
    mem_hot = big("mem-hot", used_memory=6000)
    both = big("both", used_cpu=6000, used_memory=6000)
    scores = {
        c.worker_id: c.score
        for c in (score(w, NEED, DEFAULT_CURVE, Weights()) for w in (cpu_hot, mem_hot, both))
    }
    assert scores["cpu-hot"] == scores["mem-hot"] < scores["both"]


def test_a_worker_without_capacity_counts_as_full() -> None:
    c = score(supplier(worker(cpu=0, memory=0)), NEED, DEFAULT_CURVE, Weights())
    assert c.sub_scores["cpu"] == c.sub_scores["memory"] == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("images", "image", "bonus"),
    [
        pytest.param((), IMAGE, 0.0, id="nothing-cached"),
        pytest.param((IMAGE, DIGEST), IMAGE, 0.5, id="ref-cached"),
        pytest.param(("registry.local/web:0", DIGEST), DIGEST, 0.5, id="digest-cached"),
        pytest.param(("registry.local/web:0", DIGEST), IMAGE, 0.0, id="other-tag-cached"),
        pytest.param(("registry.local/db:1",), IMAGE, 0.0, id="other-image-cached"),
    ],
)
def test_image_cached_bonus(images: tuple[str, ...], image: str, bonus: float) -> None:
    c = score(supplier(worker(images=images)), request(image=image), DEFAULT_CURVE, Weights())
    assert c.sub_scores["image_cached"] == bonus


def test_cached_image_breaks_an_otherwise_equal_choice() -> None:
    cold = big("cold", used_cpu=5000, used_memory=5000)
    assert best(util(5000, images={IMAGE}), cold) == "used5000"


@pytest.mark.parametrize(
    ("spread", "held", "expected"),
    [
        pytest.param(False, apps(web=3), None, id="off"),
        pytest.param(True, {}, 0.0, id="on-none-held"),
        pytest.param(True, apps(web=3), -3.0, id="on-three-held"),
        pytest.param(True, apps(db=5, web=1), -1.0, id="on-only-this-app-counts"),
    ],
)
def test_spread_penalty(spread: bool, held: dict[str, str], expected: float | None) -> None:
    c = score(supplier(worker(machines=held)), request(spread=spread), DEFAULT_CURVE, Weights())
    assert c.sub_scores.get("spread") == expected


@pytest.mark.parametrize(
    ("spread", "names"),
    [
        pytest.param(False, {"cpu", "memory", "image_cached"}, id="plain"),
        pytest.param(True, {"cpu", "memory", "image_cached", "spread"}, id="spread"),
    ],
)
def test_sub_scores_are_named_and_sum_to_the_score(spread: bool, names: set[str]) -> None:
    w = supplier(worker(images={IMAGE}, machines=apps(web=2), used_cpu=1000))
    c = score(w, request(spread=spread), DEFAULT_CURVE, Weights())
    assert set(c.sub_scores) == names
    assert c.score == pytest.approx(sum(c.sub_scores.values()))
    assert (c.worker_id, c.region) == (w.id, w.region)


def test_weights_scale_each_sub_score() -> None:
    w = supplier(worker(images={IMAGE}, machines=apps(web=2)))
    plain = score(w, request(spread=True), DEFAULT_CURVE, Weights()).sub_scores
    weights = Weights(cpu=2.0, memory=0.0, image_cached=3.0, spread=0.5)
    weighted = score(w, request(spread=True), DEFAULT_CURVE, weights).sub_scores
    assert weighted == pytest.approx(
        {
            "cpu": 2.0 * plain["cpu"],
            "memory": 0.0,
            "image_cached": 3.0,
            "spread": -1.0,
        }
    )


# --- the pipeline --------------------------------------------------------------------------


def ids(candidates: list[Candidate]) -> list[str]:
    return [c.worker_id for c in candidates]


def test_only_the_named_region_is_considered() -> None:
    # ams has better (fuller, cached) workers and broken ones; neither may show up for ord.
    workers = [
        *fleet(3, prefix="ord-"),
        *fleet(3, prefix="ams-ok-", region="ams", images={IMAGE}, used_cpu=3000),
        *fleet(2, prefix="ams-dead-", region="ams", status="dead"),
    ]
    decision = decide(workers, request())
    assert sorted(ids(decision.candidates)) == ["ord-0", "ord-1", "ord-2"]
    assert {c.region for c in decision.candidates} == {REGION}
    assert decision.counts() == Counter()
    assert decision.examined == 3


def test_a_region_without_workers_decides_nothing() -> None:
    decision = decide(fleet(5), request(), "nowhere")
    assert decision == Decision("nowhere")


def test_rejections_are_counted_by_reason() -> None:
    workers = [
        *fleet(2, prefix="dead-", status="dead"),
        worker("suspect", status="suspect"),
        worker("cordoned", cordoned=True),
        *fleet(3, prefix="small-", memory=512),
        worker("full", used_slots=16),
        worker("slow", cpu=500),
        worker("primary", machines={"m-primary": "web"}),
        *fleet(2, prefix="ok-"),
    ]
    decision = decide(workers, request(standby_for={"m-primary": "primary"}), sample_size=100)
    assert decision.counts() == Counter(
        {
            "dead": 2,
            "suspect": 1,
            "cordoned": 1,
            "machine_limit": 1,
            "insufficient_memory": 3,
            "insufficient_cpu": 1,
            "standby_conflict": 1,
        }
    )
    assert sorted(ids(decision.candidates)) == ["ok-0", "ok-1"]
    # Only the workers that fit the index stages are drawn, and the drawing stops once both
    # feasible ones are in: the excluded "primary" is named only if drawn before them.
    assert decision.examined == 2 + len(decision.rejections)
    assert [rj.worker_id for rj in decision.rejections] in ([], ["primary"])


def test_labels_pick_a_pool_and_count_the_rest_as_missing() -> None:
    workers = [
        *fleet(3, prefix="gpu-", labels={"gpu": "a100"}),
        *fleet(2, prefix="gpu-h-", labels={"gpu": "h100"}),
        *fleet(4, prefix="plain-"),
        worker("gpu-dead", status="dead", labels={"gpu": "a100"}),
    ]
    decision = decide(workers, request(labels={"gpu": "a100"}))
    assert sorted(ids(decision.candidates)) == ["gpu-0", "gpu-1", "gpu-2"]
    assert decision.counts() == Counter({"missing_label": 6, "dead": 1})


class CountingCheck:
    """A first candidate stage that only counts the workers it is asked about."""

    __name__ = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, w: Supplier, r: Request) -> tuple[str, str] | None:
        self.calls += 1
        return None


@pytest.mark.parametrize("size", [pytest.param(n, id=f"{n}-workers") for n in (10, 1000, 10_000)])
def test_power_of_d_choices_examines_a_bounded_sample(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    scored: list[str] = []
    real_score = placement.score

    def counting_score(w: Supplier, r: Request, curve: Curve, weights: Weights) -> Candidate:
        scored.append(w.id)
        return real_score(w, r, curve, weights)

    monkeypatch.setattr(placement, "score", counting_score)
    counter = CountingCheck()
    workers = fleet(size)
    workers[0] = worker("w0", machines=apps(web=1))
    supply = supply_of(workers)
    pipeline = Pipeline(checks=(counter, *CANDIDATE_CHECKS), sample_size=8)
    decision = pipeline.decide(supply, request(max_per_worker=3), REGION)
    expected = min(size, 8)
    assert len(decision.candidates) == expected
    assert len(scored) == decision.examined == expected
    # The candidate stages are asked about the app's own workers only, whatever the size.
    assert counter.calls == 1


@pytest.mark.parametrize(
    ("feasible", "infeasible", "candidates"),
    [
        pytest.param(0, 300, 0, id="none-feasible"),
        pytest.param(3, 300, 3, id="fewer-than-sample"),
        pytest.param(8, 300, 8, id="exactly-sample"),
        pytest.param(500, 500, 8, id="half-feasible"),
    ],
)
def test_draws_until_the_sample_is_full(feasible: int, infeasible: int, candidates: int) -> None:
    # The infeasible ones fail a candidate stage (the app's spread), so they are drawn and
    # rejected by name, or counted when the drawing stops before them.
    workers = fleet(feasible, prefix="ok-") + fleet(
        infeasible, prefix="full-", machines=apps(web=2)
    )
    decision = decide(workers, request(max_per_worker=2), sample_size=8)
    assert len(decision.candidates) == candidates
    # Every worker drawn is either a candidate or a named rejection.
    assert decision.examined == len(decision.rejections) + candidates
    assert {r.reason for r in decision.rejections} <= {"app_spread_limit"}
    assert decision.counts() == Counter({"app_spread_limit": infeasible})
    # It stops once the sample is full or every feasible worker is in.
    assert decision.examined < len(workers)


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        pytest.param({"used_disk": 20480}, "insufficient_disk", id="disk"),
        pytest.param({"machines": apps(web=2)}, "app_spread_limit", id="spread"),
    ],
)
def test_ten_thousand_workers_that_fit_memory_and_cpu_refuse_without_a_scan(
    kw: dict[str, Any], reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every worker has the memory and the CPU; none has the disk, or each already holds as
    # many of the app as it may. The refusal is exact without drawing them one by one.
    supply = supply_of(fleet(10_000, **kw))
    drawn: list[int] = []
    real_draw = placement.Fit.draw

    def counting_draw(fit: placement.Fit, rng: Any) -> Any:
        for slot in real_draw(fit, rng):
            drawn.append(slot)
            yield slot

    monkeypatch.setattr(placement.Fit, "draw", counting_draw)
    r = request(disk=1, max_per_worker=2, seed="k")
    decision = Pipeline(sample_size=8).decide(supply, r, REGION)
    assert decision.candidates == []
    assert decision.counts() == Counter({reason: 10_000})
    assert (drawn, decision.examined, decision.rejections) == ([], 0, [])
    # One worker with room is found, and it is the only one drawn.
    supply.update("roomy", region=REGION, labels={}, status=ALIVE, **room(worker("roomy")))
    decision = Pipeline(sample_size=8).decide(supply, r, REGION)
    assert [c.worker_id for c in decision.candidates] == ["roomy"]
    assert decision.counts() == Counter({reason: 10_000})


def room(w: Worker) -> dict[str, Resources]:
    return {"total": w.total, "free": w.free}


def test_a_standby_never_lands_with_its_primary() -> None:
    workers = fleet(20)
    workers[7] = worker("w7", machines={"m-primary": "web"})
    supply = supply_of(workers)
    for seed in range(30):
        r = request(standby_for={"m-primary": "w7"}, seed=f"key-{seed}")
        decision = Pipeline(sample_size=8).decide(supply, r, REGION)
        assert "w7" not in ids(decision.candidates)
        assert {rj.worker_id for rj in decision.rejections} <= {"w7"}


def test_the_same_seed_gives_the_same_decision() -> None:
    workers = fleet(200) + fleet(100, prefix="dead-", status="dead")
    pipeline = Pipeline(sample_size=8)
    first = pipeline.decide(supply_of(workers), request(seed="idem-1"), REGION)
    again = pipeline.decide(supply_of(reversed(workers)), request(seed="idem-1"), REGION)
    assert ids(again.candidates)[0] == ids(first.candidates)[0]  # the key's own worker
    assert pipeline.decide(supply_of(workers), request(seed="idem-1"), REGION) == first
    other = pipeline.decide(supply_of(workers), request(seed="idem-2"), REGION)
    assert ids(other.candidates) != ids(first.candidates)


def test_a_key_picks_its_worker_whatever_else_the_view_says() -> None:
    # Two flaps whose views differ in the free resources of other workers, and in which
    # workers they know at all, still try the same worker first for the same key.
    workers = fleet(50)
    changed = [worker(w.id, used_cpu=1500, used_memory=4000) for w in workers[25:]]
    for i in range(20):
        r = request(seed=f"key-{i}")
        a = decide(workers, r)
        b = decide(workers[:25] + changed + fleet(5, prefix="new-"), r)
        home = a.candidates[0].worker_id
        if not home.startswith("new-") and b.candidates[0].worker_id.startswith("new-"):
            continue  # a worker only b knows came first on its ring: fair
        assert b.candidates[0].worker_id == home


def test_keyed_creates_spread_evenly_over_equal_workers() -> None:
    # Each key's own worker comes from the ring: with enough points per worker, equal workers
    # get about as many keys each (with 4 points they got from 0.4x to 1.6x the mean).
    supply = supply_of(fleet(10))
    homes = Counter(
        Pipeline().decide(supply, request(seed=f"key-{i}"), REGION).keyed for i in range(2000)
    )
    assert sorted(homes) == sorted(f"w{i}" for i in range(10))
    assert all(150 <= n <= 250 for n in homes.values()), homes


def test_different_seeds_spread_ties() -> None:
    supply = supply_of(fleet(4))
    winners = {
        Pipeline().decide(supply, request(seed=f"key-{i}"), REGION).candidates[0].worker_id
        for i in range(40)
    }
    assert len(winners) > 1


def test_ties_without_a_seed_spread_the_load() -> None:
    supply = supply_of(fleet(4))
    winners = Counter(
        Pipeline().decide(supply, request(), REGION).candidates[0].worker_id for _ in range(60)
    )
    assert len(winners) > 1


def test_ties_keep_a_better_worker_first() -> None:
    # Drawing order breaks ties only: a better worker wins whenever it is drawn.
    supply = supply_of([*fleet(5), worker("cached", images={IMAGE})])
    for _ in range(20):
        decision = Pipeline().decide(supply, request(), REGION)
        assert decision.candidates[0].worker_id == "cached"
        assert [c.score for c in decision.candidates] == sorted(
            (c.score for c in decision.candidates), reverse=True
        )


# --- room (ListRegions' fits) --------------------------------------------------------------


def exact_room(workers: list[Worker], r: Request) -> int:
    g = r.guest
    out = 0
    for w in workers:
        f = w.free
        limits = [f.machines, f.cpu_millicores // g.cpu_millicores, f.memory_mib // g.memory_mib]
        out += max(0, min(limits))
    return out


@pytest.mark.parametrize("shapes", [pytest.param(n, id=f"{n}-shapes") for n in (1, 40, 500)])
def test_room_is_exact_over_few_shapes_and_a_bound_over_many(shapes: int) -> None:
    # 1,000 workers in `shapes` distinct free shapes; a third have no room at all.
    workers = [
        worker(f"w{i}", used_memory=8192 if i % 3 == 0 else (i % shapes) * 8) for i in range(1000)
    ]
    r = request(cpu=100, memory=1000)
    pool = supply_of(workers).pool(REGION)
    assert pool is not None
    got = pool.room(r.guest.memory_mib, r.guest.cpu_millicores, r.guest.disk_mib)
    exact = exact_room(workers, r)
    if len(pool.shapes) <= supply_module.ROOM_SHAPES:
        assert got == exact
    else:
        # Each worker that fits counts at least once, and none more than it holds.
        assert pool.fit(1000, 100).fitting <= got <= exact
