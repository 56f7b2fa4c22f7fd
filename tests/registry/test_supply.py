"""The supply the view keeps step by step equals one built from scratch from the view's state.

Any sequence of worker arrivals (and moves between regions, relabelling), snapshots (rows that
appear and rows that go), changes, heartbeats (free resources, cordons), silences (suspect,
dead) and removals (dead past `forget_after`) must leave every pool, tree, ring, count and sum
exactly as a fresh `Supply` fed the final state would have them; the view's own indexes (by
app, by key) likewise. A second view follows the first through `apply_upstream` (what it
relays, as a Follow stream would), and its supply must equal a rebuilt one too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from registry.supply import SLOT_BITS, SLOT_MASK, FitTree, Pool, Resources, Supply
from registry.v1 import registry_pb2
from registry.view import DESTROYED, ReplicaEvent, View

S = pb.MachineState
WORKERS = ("w0", "w1", "w2", "w3", "w4")
LABELS = ({}, {"gpu": "x"}, {"gpu": "x", "ssd": "1"})
STATES = (S.MACHINE_STATE_STARTED, S.MACHINE_STATE_STOPPED, DESTROYED)


def info(worker_id: str, region: str, labels: dict[str, str]) -> pb.WorkerInfo:
    return pb.WorkerInfo(id=worker_id, region=region, address="127.0.0.1:1", labels=labels)


def row(worker_id: str, n: int, app: str, state: int, key: str) -> pb.Machine:
    return pb.Machine(
        id=f"{worker_id}-m{n}",
        app=app,
        worker_id=worker_id,
        state=state,  # type: ignore[arg-type]
        idempotency_key=key,
        events=[pb.MachineEvent(seq=1, type="create")],
    )


rows = st.builds(
    row,
    st.just(""),
    st.integers(0, 5),
    st.sampled_from(["web", "db"]),
    st.sampled_from(STATES),
    st.sampled_from(["", "", "k1", "k2"]),
)

steps = st.one_of(
    st.tuples(
        st.just("add"),
        st.sampled_from(WORKERS),
        st.sampled_from(["a", "b"]),
        st.sampled_from(range(len(LABELS))),
    ),
    st.tuples(st.just("snapshot"), st.sampled_from(WORKERS), st.lists(rows, max_size=4)),
    st.tuples(st.just("change"), st.sampled_from(WORKERS), rows),
    st.tuples(
        st.just("heartbeat"),
        st.sampled_from(WORKERS),
        st.booleans(),
        st.tuples(*(st.sampled_from([-5, 0, 1, 500, 4000]) for _ in range(4))),
        st.tuples(*(st.sampled_from([0, 1000, 4000]) for _ in range(4))),
    ),
    # Time passes: liveness is judged, the longest dead are forgotten.
    st.tuples(st.just("wait"), st.sampled_from([0.1, 0.7, 1.5, 2.5])),
)


def apply(view: View, step: tuple[Any, ...], now: float) -> list[registry_pb2.FollowResponse]:
    """Apply a step to `view`; what it relays to a follower (as Follow stream items)."""
    kind, worker_id = step[0], step[1] if len(step) > 1 else ""
    if kind == "add":
        return _relay(view, view.add(info(worker_id, step[2], LABELS[step[3]]), now).events)
    if kind == "wait":
        out = _relay(view, view.tick(now))
        _, gone = view.forget(now)
        assert all(g not in view for g in gone)
        return out
    if worker_id not in view:
        return _relay(view, view.tick(now))
    seq = view.resume_seq(worker_id)
    if kind == "snapshot":
        machines = {m.id: m for m in (_own(m, worker_id) for m in step[2])}
        snap = w.Snapshot(seq=seq + 1, machines=machines.values())
        item = w.WatchEventsResponse(snapshot=snap)
    elif kind == "change":
        m = _own(step[2], worker_id)
        change = w.MachineChange(event=pb.MachineEvent(seq=seq + 1, machine_id=m.id), machine=m)
        item = w.WatchEventsResponse(change=change)
    else:
        _, _, cordoned, free, total = step
        cap = pb.Capacity(
            total=pb.Resources(**dict(zip(_FIELDS, total, strict=True))),
            free=pb.Resources(**dict(zip(_FIELDS, free, strict=True))),
            cordoned=cordoned,
        )
        cap.images.add(ref=f"img-{free[0]}", digest="sha256:x")
        item = w.WatchEventsResponse(heartbeat=w.Heartbeat(capacity=cap))
    applied = view.apply(worker_id, item, now)
    out = _relay(view, applied.events)
    if applied.relay:
        out.append(view.relay(worker_id, item))
    return out


def _relay(view: View, events: list[ReplicaEvent]) -> list[registry_pb2.FollowResponse]:
    """Status-only items for the workers whose status or info changed (gone ones: nothing)."""
    return [
        view.relay(e.worker_id, None) for e in events if e.kind == "worker" and e.worker_id in view
    ]


_FIELDS = ("cpu_millicores", "memory_mib", "disk_mib", "machines")


def _own(m: pb.Machine, worker_id: str) -> pb.Machine:
    out = pb.Machine()
    out.CopyFrom(m)
    out.worker_id = worker_id
    out.id = f"{worker_id}{m.id}"
    return out


def rebuilt(view: View) -> Supply:
    """A supply fed the view's final state in one go."""
    supply = Supply()
    for v in view.workers():
        cap = v.capacity
        supply.update(
            v.info.id,
            region=v.info.region,
            labels=dict(v.info.labels),
            status=v.status,
            cordoned=cap.cordoned,
            total=Resources.of(cap.total),
            free=Resources.of(cap.free),
            images=frozenset(x for img in cap.images for x in (img.ref, img.digest) if x),
        )
        for m in view.machines(worker_id=v.info.id):
            if m.state != DESTROYED:
                supply.count(v.info.id, m.app, 1)
    return supply


def tree_layout(tree: FitTree) -> tuple[Any, ...]:
    nodes = {i: {j: list(node) for j, node in inner.items()} for i, inner in tree.nodes.items()}
    return nodes, tree.sizes


def relaid(tree: FitTree) -> FitTree:
    """The same entries filed from scratch in the same ranges."""
    fresh = FitTree()
    fresh.memory_bits, fresh.cpu_bits = tree.memory_bits, tree.cpu_bits
    for slot, (memory, cpu, disk) in tree._filed.items():
        fresh.add(memory, cpu, disk, slot)
    return fresh


def pool_print(supply: Supply, pool: Pool) -> dict[str, Any]:
    """Everything a pool holds, with slots (which differ between supplies) read as ids."""

    def named(entry: int) -> tuple[int, str]:
        return entry >> SLOT_BITS, supply.at(entry & SLOT_MASK).id

    return {
        "figures": (pool.workers, +pool.by_status, pool.cordoned, pool.ready, pool.full),
        "sums": (pool.total, pool.free, +pool.shapes),
        # What is filed (the layout depends on the ranges, which only ever widen), and that
        # the layout is the one those entries give in those ranges.
        "tree": sorted((supply.at(slot).id, sizes) for slot, sizes in pool.tree._filed.items()),
        "laid out": tree_layout(pool.tree) == tree_layout(relaid(pool.tree)),
        "ring": sorted(named(e) for e in pool.ring),
    }


def supply_print(supply: Supply) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for region in sorted(supply.regions()):
        for labels in LABELS:
            pool = supply.pool(region, labels)
            assert pool is not None
            out[f"{region}/{sorted(labels.items())}"] = pool_print(supply, pool)
        for worker_id, s in supply.members(region).items():
            out[worker_id] = (
                s.region,
                dict(s.labels),
                s.status,
                s.cordoned,
                s.total,
                s.free,
                s.images,
                s.apps,
            )
        for app in ("web", "db"):
            out[f"holders/{region}/{app}"] = {
                k: n for k, n in supply.holders(app).items() if k in supply.members(region)
            }
    out["holders"] = {app: dict(supply.holders(app)) for app in ("web", "db")}
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(steps, max_size=40))
def test_the_kept_supply_equals_a_rebuilt_one(script: list[tuple[Any, ...]]) -> None:
    view = View(suspect_after=0.6, dead_after=1.0, forget_after=2.0)
    follower = View(suspect_after=0.6, dead_after=1.0, forget_after=2.0, upstream=True)
    now = 0.0
    for step in script:
        if step[0] == "wait":
            now += step[1]
        for item in apply(view, step, now):
            follower.apply_upstream(item, now)
        follower.tick(now)
        if step[0] == "wait":
            follower.forget(now)
        if step[0] == "add":  # label pools exist from the start and are kept from then on
            for v in (view, follower):
                for labels in LABELS:
                    v.supply.pool(step[2], labels)
    assert supply_print(view.supply) == supply_print(rebuilt(view))
    assert supply_print(follower.supply) == supply_print(rebuilt(follower))
    # The view's own indexes: by app, and by key (the latest row with a key holds it).
    everything = view.machines()
    for app in ("web", "db"):
        assert sorted(m.id for m in view.machines(app=app)) == sorted(
            m.id for m in everything if m.app == app
        )
    for m in everything:
        assert m.events == []  # the event tail stays with the worker
        if m.idempotency_key:
            found = view.by_key(m.app, m.idempotency_key)
            assert found is not None
            assert found.idempotency_key == m.idempotency_key
    # Liveness judged from the heads alone matches judging everyone.
    for v in view.workers():
        assert v.status == view._age_status(view._members[v.info.id], now) or not v.last_heartbeat


def test_counts_follow_rows_through_destroy_and_drop() -> None:
    view = View(suspect_after=0.6, dead_after=1.0)
    view.add(info("w0", "a", {}), 0.0)
    web = row("w0", 1, "web", S.MACHINE_STATE_STARTED, "k1")
    snap = w.Snapshot(seq=1, machines=[web])
    view.apply("w0", w.WatchEventsResponse(snapshot=snap), 0.0)
    s = view.supply.supplier("w0")
    assert s is not None
    assert s.apps == {"web": 1}
    web.state = DESTROYED
    view.apply(
        "w0",
        w.WatchEventsResponse(change=w.MachineChange(event=pb.MachineEvent(seq=2), machine=web)),
        0.0,
    )
    assert s.apps == {}
    view.apply("w0", w.WatchEventsResponse(snapshot=w.Snapshot(seq=3)), 0.0)
    assert (s.apps, view.machines(), view.by_key("web", "k1")) == ({}, [], None)
    assert Counter(view.supply.regions()["a"].by_status) == Counter({0: 1})


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),  # the slot
            st.booleans(),  # placed (else removed)
            st.integers(0, 5000),  # free memory: small moves and, past 1024, a wider tree
            st.integers(0, 1500),  # free CPU
            st.sampled_from([0, 0, 0, 7]),  # free disk: mostly unchanged by a move
        ),
        max_size=60,
    )
)
def test_a_moved_worker_is_filed_as_if_added_afresh(
    script: list[tuple[int, bool, int, int, int]],
) -> None:
    tree = FitTree()
    for slot, placed, memory, cpu, disk in script:
        if placed:
            tree.place(memory, cpu, disk, slot)
        elif slot in tree:
            tree.remove(slot)
        assert tree_layout(tree) == tree_layout(relaid(tree))
        if placed:
            assert tree._filed[slot] == (memory, cpu, disk)
