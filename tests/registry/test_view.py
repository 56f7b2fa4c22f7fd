"""The replica's pure state: applying streams in seq order, liveness by heartbeat age."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from model.pages import page
from registry.errors import (
    BrokenSnapshot,
    InvalidArgument,
    LogRestarted,
    SequenceGap,
    WrongWorker,
)
from registry.rows import MachineQuery
from registry.v1 import registry_pb2 as r
from registry.view import (
    ALIVE,
    DEAD,
    SUSPECT,
    TICK_BATCH,
    UNKNOWN,
    Added,
    View,
    check_worker_info,
)
from tests.registry.support import MALFORMED_WORKERS, view_of

S = pb.MachineState
T0 = 1_700_000_000.0


def info(
    worker_id: str = "w1",
    region: str = "ams",
    *,
    address: str = "127.0.0.1:5001",
    boot_id: str = "b1",
    labels: dict[str, str] | None = None,
) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        id=worker_id, region=region, address=address, boot_id=boot_id, labels=labels
    )


def machine(
    machine_id: str, state: int = S.MACHINE_STATE_CREATED, app: str = "web", worker: str = "w1"
) -> pb.Machine:
    return pb.Machine(id=machine_id, app=app, worker_id=worker, state=state)  # type: ignore[arg-type]


def snapshot(seq: int, *machines: pb.Machine) -> w.WatchEventsResponse:
    return w.WatchEventsResponse(snapshot=w.Snapshot(seq=seq, machines=machines))


def change(seq: int, m: pb.Machine) -> w.WatchEventsResponse:
    return w.WatchEventsResponse(
        change=w.MachineChange(event=pb.MachineEvent(seq=seq, machine_id=m.id), machine=m)
    )


def heartbeat(seq: int = 0, worker: pb.WorkerInfo | None = None) -> w.WatchEventsResponse:
    return w.WatchEventsResponse(
        heartbeat=w.Heartbeat(
            seq=seq,
            worker=worker or info(),
            capacity=pb.Capacity(free=pb.Resources(memory_mib=512)),
        )
    )


def view_with(*workers: pb.WorkerInfo, upstream: bool = False) -> View:
    view = View(suspect_after=0.6, dead_after=1.0, upstream=upstream)
    for wi in workers:
        view.add(wi, T0)
    return view


def state_of(view: View, machine_id: str) -> int | None:
    row = view.machine(machine_id)
    return None if row is None else row.state


# -- applying in order ---------------------------------------------------------------------------


def test_a_snapshot_then_consecutive_changes_build_the_rows() -> None:
    view = view_with(info())
    applied = view.apply("w1", snapshot(3, machine("m1"), machine("m2")), T0)
    assert {e.machine_id for e in applied.events} == {"m1", "m2"}
    assert applied.relay
    view.apply("w1", change(4, machine("m1", S.MACHINE_STATE_STARTED)), T0)
    view.apply("w1", change(5, machine("m3")), T0)
    assert state_of(view, "m1") == S.MACHINE_STATE_STARTED
    assert {m.id for m in view.machines()} == {"m1", "m2", "m3"}
    assert view.resume_seq("w1") == 5


def test_a_change_at_or_below_the_applied_seq_is_ignored() -> None:
    view = view_with(info())
    view.apply("w1", snapshot(5, machine("m1", S.MACHINE_STATE_STARTED)), T0)
    # a replay overlapping the snapshot: seq 4 and 5 are already in it
    for seq in (4, 5):
        applied = view.apply("w1", change(seq, machine("m1", S.MACHINE_STATE_STOPPED)), T0)
        assert applied.events == []
        assert not applied.relay
    assert state_of(view, "m1") == S.MACHINE_STATE_STARTED
    assert view.resume_seq("w1") == 5


def test_a_change_that_skips_a_seq_is_a_gap_and_changes_nothing() -> None:
    view = view_with(info())
    view.apply("w1", snapshot(5), T0)
    with pytest.raises(SequenceGap, match="seq 7 does not follow the applied seq 5"):
        view.apply("w1", change(7, machine("m1")), T0)
    assert view.machine("m1") is None
    assert view.resume_seq("w1") == 5


def test_a_snapshot_replaces_the_rows_and_reports_the_gone_ones() -> None:
    view = view_with(info())
    view.apply("w1", snapshot(2, machine("m1"), machine("m2", S.MACHINE_STATE_DESTROYED)), T0)
    # compaction dropped the destroyed m2; m1 started meanwhile
    applied = view.apply("w1", snapshot(9, machine("m1", S.MACHINE_STATE_STARTED)), T0)
    assert [(e.machine_id, e.machine is None) for e in applied.events] == [
        ("m2", True),
        ("m1", False),
    ]
    assert view.machine("m2") is None
    assert view.machines(app="web") == [machine("m1", S.MACHINE_STATE_STARTED)]
    # the same snapshot again changes nothing and says so
    assert view.apply("w1", snapshot(9, machine("m1", S.MACHINE_STATE_STARTED)), T0).events == []


def test_an_older_snapshot_is_ignored_unless_the_worker_log_was_reset() -> None:
    view = view_with(info())
    view.apply("w1", snapshot(9, machine("m1")), T0)
    assert not view.apply("w1", snapshot(4), T0).relay
    assert view.machine("m1") is not None
    # the worker said our from_seq is ahead of its log: it was wiped
    view.reset("w1")
    assert view.resume_seq("w1") == 0
    view.apply("w1", snapshot(4, machine("m7")), T0)
    assert view.machine("m1") is None
    assert view.machine("m7") is not None
    assert view.resume_seq("w1") == 4
    assert view_of(view, "w1").snapshots == 2


def test_rows_never_cross_workers() -> None:
    view = view_with(info("w1"), info("w2", "syd", address="127.0.0.1:5002"))
    view.apply("w1", snapshot(1, machine("a1", worker="w1")), T0)
    view.apply("w2", snapshot(1, machine("b1", worker="w2")), T0)
    view.apply("w2", snapshot(2), T0)  # w2 dropped its row; w1's stays
    assert [m.id for m in view.machines()] == ["a1"]
    assert view.machines(region="syd") == []
    assert [m.id for m in view.machines(region="ams", app="web")] == ["a1"]
    assert view.machines(worker_id="w2") == []
    assert view.regions() == {"ams", "syd"}


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"app": "web"}, ["a1", "a2", "s1"]),
        ({"app": "web", "region": "ams"}, ["a1", "a2"]),
        ({"app": "web", "worker_id": "w2"}, ["s1"]),
        ({"app": "web", "worker_id": "w2", "region": "ams"}, []),
        ({"app": "db"}, ["d1"]),
        ({"app": "none"}, []),
        ({"region": "syd"}, ["s1"]),
    ],
)
def test_machines_filtered_by_app_region_and_worker(
    filters: dict[str, str], expected: list[str]
) -> None:
    view = view_with(info("w1"), info("w2", "syd"))
    view.apply("w1", snapshot(1, machine("a1"), machine("a2"), machine("d1", app="db")), T0)
    view.apply("w2", snapshot(1, machine("s1", worker="w2")), T0)
    assert sorted(m.id for m in view.machines(**filters)) == expected  # type: ignore[arg-type]


def test_machines_by_app_follow_an_app_change() -> None:
    view = view_with(info())
    view.apply("w1", snapshot(0), T0)
    view.apply("w1", change(1, machine("m1", app="old")), T0)
    view.apply("w1", change(2, machine("m1", app="new")), T0)
    assert view.machines(app="old") == []
    assert [m.id for m in view.machines(app="new")] == ["m1"]


@pytest.mark.parametrize("size", [1, 2, 3, 500])
def test_a_page_of_machines_is_the_page_of_every_machine(size: int) -> None:
    """machine_page reads the page off the index: the same pages, in the same order, as
    model.pages.page over every machine, whatever the filters."""
    view = view_with(info("w1", "ams"), info("w2", "syd"))
    states = [S.MACHINE_STATE_STARTED, S.MACHINE_STATE_STOPPED, S.MACHINE_STATE_DESTROYED]
    for worker in ["w1", "w2"]:
        rows = [
            machine(f"{worker}-m{i}", states[i % 3], app="web" if i % 2 else "db", worker=worker)
            for i in range(7)
        ]
        view.apply(worker, snapshot(1, *rows), T0)
    filters = [
        (None, None, lambda mid, app, state: True),
        ("web", None, lambda mid, app, state: True),
        (None, "syd", lambda mid, app, state: state != S.MACHINE_STATE_DESTROYED),
        ("db", "ams", lambda mid, app, state: mid.endswith(("1", "2", "4"))),
    ]
    for app, region, keep in filters:
        everything = [
            m for m in view.machines(app=app, region=region) if keep(m.id, m.app, m.state)
        ]
        token, got, want = "", [], []
        while True:
            listed, token = view.machine_page(MachineQuery(app, region, token, size, keep))
            expected, expected_token = page(everything, size, want[-1].id if want else "")
            assert (listed, token) == (expected, expected_token)
            got += listed
            want += expected
            if not token:
                break
        assert [m.id for m in got] == sorted(m.id for m in everything)


def test_a_heartbeat_brings_capacity_and_worker_info_but_keeps_the_address() -> None:
    view = view_with(info())
    theirs = info(boot_id="b2", address="10.0.0.9:1", labels={"gpu": "a"})
    applied = view.apply("w1", heartbeat(0, theirs), T0 + 0.1)
    worker = view.worker("w1")
    assert worker is not None
    assert worker.status == ALIVE
    assert worker.last_heartbeat == T0 + 0.1
    assert worker.capacity.free.memory_mib == 512
    assert worker.info.boot_id == "b2"
    assert dict(worker.info.labels) == {"gpu": "a"}
    assert worker.info.address == "127.0.0.1:5001"  # where we reach it, not what it says
    assert [e.kind for e in applied.events] == ["worker"]


# -- liveness ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("silent_for", "status"),
    [(0.0, ALIVE), (0.59, ALIVE), (0.61, SUSPECT), (0.99, SUSPECT), (1.01, DEAD), (60.0, DEAD)],
)
def test_status_is_the_age_of_the_last_heartbeat(silent_for: float, status: int) -> None:
    view = view_with(info())
    view.apply("w1", heartbeat(), T0)
    view.tick(T0 + silent_for)
    assert view_of(view, "w1").status == status


def test_alive_suspect_dead_and_alive_again() -> None:
    view = view_with(info())
    assert view_of(view, "w1").status == UNKNOWN  # never heard from
    assert [e.status for e in view.apply("w1", heartbeat(), T0).events] == [ALIVE]
    # the worker goes quiet here
    assert view.tick(T0 + 0.3) == []
    assert [e.status for e in view.tick(T0 + 0.7)] == [SUSPECT]
    assert view.tick(T0 + 0.8) == []  # no repeat while nothing changes
    assert [e.status for e in view.tick(T0 + 1.2)] == [DEAD]
    # it comes back
    assert [e.status for e in view.apply("w1", heartbeat(), T0 + 5).events] == [ALIVE]


def test_a_worker_never_heard_from_turns_suspect_then_dead() -> None:
    view = view_with(info())
    assert view.tick(T0 + 0.5) == []
    assert [e.status for e in view.tick(T0 + 0.61)] == [SUSPECT]
    assert [e.status for e in view.tick(T0 + 1.01)] == [DEAD]


def test_a_fleet_gone_quiet_at_once_is_judged_a_batch_at_a_time() -> None:
    view = View(suspect_after=0.6, dead_after=1.0)
    n = 1000
    for i in range(n):
        wi = info(f"w{i}")
        view.add(wi, T0)
        view.apply(wi.id, heartbeat(worker=wi), T0)
    # the whole fleet goes quiet here (its upstream is lost); the clock is moved by hand
    for now, status in ((T0 + 0.7, SUSPECT), (T0 + 1.1, DEAD)):
        batches = []
        while view.due(now) and len(batches) <= n:
            batches.append(len(view.tick(now)))
        assert max(batches) == TICK_BATCH  # the loop is let go between batches
        assert sum(batches) == n
        assert {v.status for v in view.workers()} == {status}
        assert +view.supply.regions()["ams"].by_status == Counter({status: n})
        assert view.tick(now) == []


def test_the_oldest_news_are_the_heads_of_the_liveness_queues() -> None:
    view = View(suspect_after=0.6, dead_after=1.0)
    for i in range(5):
        wi = info(f"w{i}")
        view.add(wi, T0)
        view.apply(wi.id, heartbeat(worker=wi), T0 + i * 0.3)
    view.tick(T0 + 1.25)  # w0 dead, w1 suspect, the rest alive
    assert view.oldest_news(3) == [("w1", T0 + 0.3), ("w2", T0 + 0.6), ("w3", T0 + 0.9)]
    assert [worker_id for worker_id, _ in view.oldest_news(10)] == ["w1", "w2", "w3", "w4"]
    assert view.oldest_news(0) == []


@pytest.mark.parametrize(
    ("suspect_after", "dead_after", "message"),
    [
        (0.0, 1.0, "suspect_after must be > 0"),
        (-1.0, 1.0, "suspect_after must be > 0"),
        (1.0, 1.0, r"dead_after \(1.0s\) must be greater than suspect_after \(1.0s\)"),
        (2.0, 1.0, "dead_after"),
    ],
)
def test_timeouts_are_validated(suspect_after: float, dead_after: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        View(suspect_after=suspect_after, dead_after=dead_after)


# -- membership ----------------------------------------------------------------------------------


def test_adding_a_known_worker_refollows_only_when_it_moved_or_restarted() -> None:
    view = view_with(info())
    assert view.add(info(), T0) == Added(new=False, refollow=False, events=[])
    assert view.add(info(address="127.0.0.1:5009"), T0).refollow
    assert view.add(info(address="127.0.0.1:5009", boot_id="b2"), T0).refollow
    relabelled = view.add(info(address="127.0.0.1:5009", boot_id="b2", labels={"x": "y"}), T0)
    assert not relabelled.refollow
    assert [e.kind for e in relabelled.events] == ["worker"]


@pytest.mark.parametrize(("worker", "field"), MALFORMED_WORKERS)
def test_a_malformed_worker_is_refused_naming_the_field(worker: pb.WorkerInfo, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_worker_info(worker)
    assert err.value.field == field
    view = view_with()
    with pytest.raises(InvalidArgument):
        view.add(worker, T0)
    assert len(view) == 0


# -- upstream mode -------------------------------------------------------------------------------


def follow(status: int, item: w.WatchEventsResponse | None = None) -> r.FollowResponse:
    resp = r.FollowResponse(worker_id="w1", status=status, worker=info())  # type: ignore[arg-type]
    if item is not None:
        resp.item.CopyFrom(item)
    return resp


def test_upstream_items_create_the_worker_and_apply_like_its_own_stream() -> None:
    view = view_with(upstream=True)
    view.apply_upstream(follow(ALIVE, snapshot(3, machine("m1"))), T0)
    view.apply_upstream(follow(ALIVE, change(4, machine("m1", S.MACHINE_STATE_STARTED))), T0)
    worker = view.worker("w1")
    assert worker is not None
    assert (worker.status, worker.seq, worker.connected) == (ALIVE, 4, True)
    assert state_of(view, "m1") == S.MACHINE_STATE_STARTED


def test_upstream_status_wins_unless_the_upstream_itself_goes_quiet() -> None:
    view = view_with(upstream=True)
    view.apply_upstream(follow(ALIVE, heartbeat()), T0)
    # the upstream judges the worker: its word is taken at once
    view.apply_upstream(follow(SUSPECT), T0 + 0.1)
    assert view_of(view, "w1").status == SUSPECT
    view.apply_upstream(follow(ALIVE, heartbeat()), T0 + 0.2)
    assert view_of(view, "w1").status == ALIVE
    # the upstream stream goes silent: our own clock says suspect, then dead
    view.disconnect_all()
    view.tick(T0 + 0.9)
    assert view_of(view, "w1").status == SUSPECT
    view.tick(T0 + 1.3)
    assert view_of(view, "w1").status == DEAD
    assert not view_of(view, "w1").connected


def test_follow_items_rebuild_the_same_view_downstream() -> None:
    upstream = view_with(info())
    upstream.apply("w1", snapshot(2, machine("m1"), machine("m2")), T0)
    upstream.apply("w1", heartbeat(2), T0)
    downstream = view_with(upstream=True)
    for item in upstream.follow_items():
        downstream.apply_upstream(item, T0)
    assert downstream.machines() == upstream.machines()
    # the same worker, except that downstream it is connected (to the upstream)
    assert view_of(downstream, "w1") == dataclasses.replace(view_of(upstream, "w1"), connected=True)


def test_a_stream_from_another_worker_is_refused_whole() -> None:
    view = view_with(info("w1"))
    # someone else now listens at w1's address
    with pytest.raises(WrongWorker, match=r"expected worker w1.*from worker w2"):
        view.apply("w1", snapshot(3, machine("a", worker="w1"), machine("b", worker="w2")), T0)
    with pytest.raises(WrongWorker):
        view.apply("w1", change(1, machine("b", worker="w2")), T0)
    with pytest.raises(WrongWorker):
        view.apply("w1", heartbeat(0, info("w2")), T0)
    assert view.machines() == []
    assert view_of(view, "w1").status == UNKNOWN


# -- logs that start over, and workers forgotten ---------------------------------------------------


def epoch_snapshot(seq: int, epoch: str, *machines: pb.Machine) -> w.WatchEventsResponse:
    return w.WatchEventsResponse(snapshot=w.Snapshot(seq=seq, machines=machines, log_epoch=epoch))


def test_a_log_of_another_epoch_replaces_the_rows_never_merges_them() -> None:
    view = view_with(info())
    view.apply("w1", epoch_snapshot(5, "e1", machine("m1"), machine("m2")), T0)
    assert view.resume_epoch("w1") == "e1"
    # The worker's data was wiped and its new log grew past ours: a heartbeat says so.
    hb = heartbeat(9)
    hb.heartbeat.log_epoch = "e2"
    with pytest.raises(LogRestarted, match="log epoch e2, not e1"):
        view.apply("w1", hb, T0)
    assert (view.resume_seq("w1"), view.resume_epoch("w1")) == (0, "")
    # Followed again from 0: the new log's snapshot replaces every row, whatever its seq.
    applied = view.apply("w1", epoch_snapshot(2, "e2", machine("m9")), T0)
    assert {(e.machine_id, e.machine is None) for e in applied.events} == {
        ("m1", True),
        ("m2", True),
        ("m9", False),
    }
    assert [m.id for m in view.machines()] == ["m9"]
    # A snapshot of another log replaces the rows even when it comes first (lower seq).
    applied = view.apply("w1", epoch_snapshot(1, "e3", machine("m8")), T0)
    assert [m.id for m in view.machines()] == ["m8"]


def test_a_new_boot_with_a_lower_seq_is_a_log_that_started_over() -> None:
    view = view_with(info())
    view.apply("w1", snapshot(7, machine("m1")), T0)
    with pytest.raises(LogRestarted, match="new boot b2 at seq 3 < 7"):
        view.apply("w1", heartbeat(3, info(boot_id="b2")), T0)
    assert view.resume_seq("w1") == 0
    view.apply("w1", snapshot(3, machine("m2")), T0)
    assert [m.id for m in view.machines()] == ["m2"]
    # Through an upstream the worker is reset too, and the upstream's snapshot replaces rows.
    up = view_with(info(), upstream=True)
    up.apply_upstream(follow(ALIVE, snapshot(7, machine("m1"))), T0)
    up.apply_upstream(follow(ALIVE, heartbeat(3, info(boot_id="b2"))), T0)
    up.apply_upstream(follow(ALIVE, snapshot(3, machine("m2"))), T0)
    assert [m.id for m in up.machines()] == ["m2"]


def test_a_worker_dead_past_forget_after_is_dropped_with_its_rows() -> None:
    view = View(suspect_after=0.6, dead_after=1.0, forget_after=10.0)
    view.add(info(), T0)
    view.add(info("w2", address="127.0.0.1:5002"), T0)
    view.apply("w1", snapshot(1, machine("m1")), T0)
    view.apply("w2", snapshot(1, machine("m2", worker="w2")), T0)
    view.apply("w1", heartbeat(1), T0)
    view.tick(T0 + 5)
    assert view.forget(T0 + 5) == ([], [])  # dead, not for long enough
    view.apply("w2", heartbeat(1, info("w2", address="127.0.0.1:5002")), T0 + 10)
    view.tick(T0 + 10.5)
    events, gone = view.forget(T0 + 10.5)
    assert gone == ["w1"]
    assert [(e.kind, e.machine_id) for e in events] == [("machine", "m1"), ("worker", "")]
    assert view.worker("w1") is None
    assert view.machine("m1") is None
    assert [m.id for m in view.machines()] == ["m2"]
    assert view.supply.supplier("w1") is None  # placement no longer sees it either
    assert [w.info.id for w in view.workers()] == ["w2"]
    with pytest.raises(ValueError, match="forget_after"):
        View(suspect_after=0.6, dead_after=1.0, forget_after=1.0)


# -- snapshots in parts ----------------------------------------------------------------------


def part(seq: int, number: int, more: bool, *machines: pb.Machine) -> w.WatchEventsResponse:
    snap = w.Snapshot(seq=seq, part=number, more=more, machines=machines)
    return w.WatchEventsResponse(snapshot=snap)


def test_a_snapshot_in_parts_applies_whole_when_its_last_part_arrives() -> None:
    view = view_with(info())
    view.apply("w1", snapshot(3, machine("old")), T0)
    first = view.apply("w1", part(9, 0, True, machine("a")), T0)
    assert (first.events, first.relay) == ([], True)  # followers get the part; nothing changed
    assert state_of(view, "old") is not None
    view.apply("w1", part(9, 1, True, machine("b")), T0)
    last = view.apply("w1", part(9, 2, False, machine("c")), T0)
    assert {m.id for m in view.machines()} == {"a", "b", "c"}
    assert {e.machine_id for e in last.events} == {"old", "a", "b", "c"}
    assert view.resume_seq("w1") == 9


@pytest.mark.parametrize(
    "broken",
    [
        [part(9, 1, False, machine("b"))],  # no part 0
        [part(9, 0, True, machine("a")), part(9, 2, False, machine("c"))],  # a part missing
        [part(9, 0, True, machine("a")), change(10, machine("a"))],  # a change between parts
    ],
)
def test_a_broken_snapshot_in_parts_is_refused_and_applies_nothing(
    broken: list[w.WatchEventsResponse],
) -> None:
    view = view_with(info())
    view.apply("w1", snapshot(3, machine("old")), T0)
    *before, last = broken
    for item in before:
        view.apply("w1", item, T0)
    with pytest.raises(BrokenSnapshot):
        view.apply("w1", last, T0)
    assert {m.id for m in view.machines()} == {"old"}
    view.apply("w1", part(9, 0, False, machine("a")), T0)  # a part 0 starts over
    assert {m.id for m in view.machines()} == {"a"}


# -- keys in doubt -------------------------------------------------------------------------------


def vouching(
    sent: float, creating: tuple[str, ...] = (), worker: pb.WorkerInfo | None = None
) -> w.WatchEventsResponse:
    """A heartbeat the worker sent at `sent` (its clock), making `creating` under keys."""
    hb = heartbeat(worker=worker)
    hb.heartbeat.time.FromNanoseconds(int(sent * 1e9))
    hb.heartbeat.creating.extend(creating)
    return hb


def doubts_at(view: View, now: float, *, give_up_after: float = 30.0) -> tuple[list, list]:
    found, expired = view.key_doubts(
        ["ams"], "k", vouched_since=now - 1.0, now=now, give_up_after=give_up_after
    )
    return (
        [(d.worker_id, d.creating, d.silent_for) for d in found],
        [(d.worker_id, d.silent_for) for d in expired],
    )


def test_a_worker_heard_lately_vouches_for_the_keys_it_holds_unless_it_is_making_this_one() -> None:
    view = view_with(info("w1"), info("w2", address="127.0.0.1:5002"), info("w3", region="fra"))
    view.apply("w1", vouching(T0), T0)
    view.apply("w2", vouching(T0, creating=("w2-other",), worker=info("w2")), T0)
    assert doubts_at(view, T0 + 0.5) == ([], [])  # (w3 is of another region)

    view.apply("w2", vouching(T0 + 0.6, creating=("w2-k",), worker=info("w2")), T0 + 0.6)
    assert doubts_at(view, T0 + 0.7) == ([("w2", True, 0.0)], [])
    # Done with it: the next heartbeat lists it no more (its row came before that one).
    view.apply("w2", vouching(T0 + 0.8, worker=info("w2")), T0 + 0.8)
    assert doubts_at(view, T0 + 0.9) == ([], [])


def test_a_silent_worker_is_in_doubt_until_it_is_given_up_on() -> None:
    view = view_with(info("w1"), info("w2", address="127.0.0.1:5002"))
    view.apply("w1", vouching(T0), T0)
    view.apply("w2", vouching(T0, worker=info("w2")), T0)
    view.apply("w2", vouching(T0 + 5, worker=info("w2")), T0 + 5)
    # w1 went quiet at T0: its rows may lack a machine it made since.
    assert doubts_at(view, T0 + 5.5) == ([("w1", False, 5.5)], [])
    assert doubts_at(view, T0 + 31, give_up_after=30.0)[1] == [("w1", 31.0)]


def test_a_heartbeat_vouches_by_the_time_it_was_sent_not_when_it_arrived() -> None:
    view = view_with(info("w1"))
    # Held up in a partition for 10 s, then delivered: it says nothing of the 10 s since.
    view.apply("w1", vouching(T0), T0 + 10)
    assert doubts_at(view, T0 + 10.1) == ([("w1", False, pytest.approx(0.1))], [])


def test_a_worker_never_heard_from_is_in_doubt_from_when_it_was_learned_of() -> None:
    view = view_with(info("w1"))
    assert doubts_at(view, T0 + 2) == ([("w1", False, 2.0)], [])


def test_a_downstream_learns_what_the_worker_vouched_for_in_its_own_time() -> None:
    w2 = info("w2", address="127.0.0.1:5002")
    upstream = view_with(info("w1"), w2)
    upstream.apply("w1", vouching(T0, creating=("w1-k",)), T0 + 3)
    upstream.apply("w2", vouching(T0, worker=w2), T0 + 3)
    downstream = view_with(upstream=True)
    for item in upstream.follow_items():
        downstream.apply_upstream(item, T0 + 3)
    # What w1 was making; and w2's time, not the upstream's time of arrival.
    assert doubts_at(downstream, T0 + 0.5) == ([("w1", True, 0.0)], [])
    assert doubts_at(downstream, T0 + 3.1) == (
        [("w1", True, 0.0), ("w2", False, pytest.approx(0.1))],
        [],
    )


def test_a_worker_done_making_the_key_is_no_longer_in_doubt_for_it() -> None:
    view = view_with(info("w1"))
    view.apply("w1", vouching(T0, creating=("w1-k", "w1-other")), T0)
    assert doubts_at(view, T0 + 0.1) == ([("w1", True, 0.0)], [])
    view.apply("w1", vouching(T0 + 0.2, creating=("w1-other",)), T0 + 0.2)
    assert doubts_at(view, T0 + 0.3) == ([], [])


def test_among_ten_thousand_workers_heard_just_now_one_whose_heartbeat_was_held_is_found() -> None:
    """It arrived now, but was sent 5 s ago: it vouches for nothing since (`View._late`)."""
    view = View(suspect_after=0.6, dead_after=1.0)
    for i in range(10_000):
        worker = info(f"w{i}", address=f"127.0.0.1:{10_000 + i}")
        view.add(worker, T0)
        view.apply(worker.id, vouching(T0, worker=worker), T0)
    held = info("w5", address="127.0.0.1:10005")
    view.apply("w5", vouching(T0 - 5, worker=held), T0)
    assert doubts_at(view, T0 + 0.5) == ([("w5", False, 0.5)], [])
    view.apply("w5", vouching(T0 + 0.4, worker=held), T0 + 0.4)  # on time again
    assert doubts_at(view, T0 + 0.5) == ([], [])
