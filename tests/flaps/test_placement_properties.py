"""Placement against an exhaustive reference: every worker judged by hand, stage by stage.

The pipeline never scans: it counts from the supply's index and draws from the workers that
fit. These properties say that this is the same answer a full pass would give: a candidate is
always feasible, a region with a feasible worker always yields one, and a refusal's counts are
exactly the reference's (each worker counted once, for its first reason).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from flaps.placement import Decision, Pipeline, Request
from tests.flaps.placement_support import REGION, Worker, request, supply_of, worker

SETTINGS = settings(max_examples=150, deadline=None)
STATUSES = ("alive", "alive", "alive", "dead", "suspect")


@st.composite
def workers(draw: st.DrawFn) -> list[Worker]:
    n = draw(st.integers(0, 24))
    out = []
    for i in range(n):
        cpu, memory, disk, slots = (
            draw(st.sampled_from([0, 1000, 2000, 4000])),
            draw(st.sampled_from([0, 512, 1024, 4096])),
            draw(st.sampled_from([0, 100, 1000])),
            draw(st.integers(0, 3)),
        )
        labels = draw(st.sampled_from([{}, {"gpu": "x"}, {"gpu": "y"}, {"gpu": "x", "ssd": "1"}]))
        held = draw(st.dictionaries(st.sampled_from(["web", "db"]), st.integers(1, 3)))
        out.append(
            worker(
                f"w{i}",
                region=draw(st.sampled_from([REGION, REGION, "ams"])),
                status=draw(st.sampled_from(STATUSES)),
                cordoned=draw(st.booleans()),
                cpu=cpu,
                memory=memory,
                disk=disk,
                slots=slots,
                # Free anywhere from overcommitted to empty.
                used_cpu=draw(st.integers(0, cpu + 500)),
                used_memory=draw(st.integers(0, memory + 256)),
                used_disk=draw(st.integers(0, disk)),
                used_slots=draw(st.integers(0, slots)),
                labels=labels,
                machines={f"{app}-{k}": app for app, n in held.items() for k in range(n)},
            )
        )
    return out


@st.composite
def requests(draw: st.DrawFn, pool: list[Worker]) -> Request:
    holder = draw(st.sampled_from([None, *[w.id for w in pool]]))
    return request(
        cpu=draw(st.sampled_from([1, 500, 1000, 2500])),
        memory=draw(st.sampled_from([1, 256, 1024, 3000])),
        disk=draw(st.sampled_from([0, 0, 50, 500])),
        labels=draw(st.sampled_from([{}, {}, {"gpu": "x"}, {"gpu": "x", "ssd": "1"}])),
        max_per_worker=draw(st.integers(0, 3)),
        standby_for={"m-primary": holder} if holder else None,
        seed=draw(st.sampled_from([None, "k1", "k2"])),
    )


def first_reason(w: Worker, r: Request) -> str | None:
    """Why `w` cannot take `r`, judged by hand in the pipeline's stage order; None if it can."""
    g = r.guest
    if w.status != "alive":
        return w.status
    if w.cordoned:
        return "cordoned"
    if any(w.labels.get(k) != v for k, v in r.placement.required_labels.items()):
        return "missing_label"
    if w.free.machines < 1:
        return "machine_limit"
    if w.free.memory_mib < g.memory_mib:
        return "insufficient_memory"
    if w.free.cpu_millicores < g.cpu_millicores:
        return "insufficient_cpu"
    if w.free.disk_mib < g.disk_mib:
        return "insufficient_disk"
    if w.id in r.primaries:
        return "standby_conflict"
    held = Counter(w.machines.values())[r.app]
    if r.placement.max_per_worker and held >= r.placement.max_per_worker:
        return "app_spread_limit"
    return None


def reference(ws: list[Worker], r: Request) -> tuple[set[str], Counter[str]]:
    feasible, counts = set(), Counter[str]()
    for w in ws:
        if w.region != REGION:
            continue
        reason = first_reason(w, r)
        if reason is None:
            feasible.add(w.id)
        else:
            counts[reason] += 1
    return feasible, counts


def decide(ws: list[Worker], r: Request, sample_size: int) -> Decision:
    return Pipeline(sample_size=sample_size).decide(supply_of(ws), r, REGION)


@SETTINGS
@given(data=st.data(), sample_size=st.integers(1, 8))
def test_the_decision_agrees_with_a_full_pass(data: st.DataObject, sample_size: int) -> None:
    ws = data.draw(workers())
    r = data.draw(requests(ws))
    feasible, counts = reference(ws, r)
    decision = decide(ws, r, sample_size)
    ids = [c.worker_id for c in decision.candidates]
    # Every candidate is feasible, none twice, as many as the sample holds.
    assert set(ids) <= feasible
    assert len(ids) == len(set(ids)) == min(sample_size, len(feasible))
    # Never NO_CAPACITY while a worker can take it; a refusal counts exactly.
    if not feasible:
        assert decision.counts() == counts
    # Rejections named one by one are of workers drawn, never of candidates.
    assert not {rj.worker_id for rj in decision.rejections} & set(ids)


@SETTINGS
@given(data=st.data())
def test_a_key_picks_a_feasible_worker_first_and_always_the_same(data: st.DataObject) -> None:
    ws = data.draw(workers())
    r = data.draw(requests(ws))
    feasible, _ = reference(ws, r)
    first = decide(ws, r, 8)
    assert bool(first.candidates) == bool(feasible)
    if r.seed is not None and first.candidates:
        again = decide(list(reversed(ws)), r, 8)  # another flaps, filed in another order
        assert again.candidates[0].worker_id == first.candidates[0].worker_id


def test_ten_thousand_workers_of_which_one_fits() -> None:
    # Half have memory but no CPU, half CPU but no memory: no single order finds the one
    # that has both, yet the index does, and without looking at the others one by one.
    ws = [
        worker(f"m{i}", cpu=4000, used_cpu=3900, memory=8192)
        if i % 2
        else worker(f"c{i}", cpu=4000, memory=8192, used_memory=8000)
        for i in range(9_999)
    ]
    ws.insert(4321, worker("the-one", cpu=4000, memory=8192))
    r = request(cpu=1000, memory=1024)
    decision = decide(ws, r, 8)
    assert [c.worker_id for c in decision.candidates] == ["the-one"]
    assert decision.examined == 1
    assert decision.counts() == Counter({"insufficient_memory": 5000, "insufficient_cpu": 4999})


def test_a_full_region_of_ten_thousand_refuses_with_exact_counts() -> None:
    ws = [
        worker(f"w{i}", used_memory=8192 if i % 3 else 0, used_cpu=0 if i % 3 else 4000)
        for i in range(10_000)
    ]
    decision = decide(ws, request(cpu=1000, memory=1024), 8)
    assert decision.candidates == []
    assert decision.counts() == Counter({"insufficient_memory": 6666, "insufficient_cpu": 3334})
    assert decision.examined == 0
