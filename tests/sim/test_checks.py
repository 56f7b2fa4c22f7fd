"""Each checker of sim.checks fails on a history that breaks its invariant, and passes one
that keeps them all."""

from __future__ import annotations

import pytest

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from sim import checks
from sim.checks import Call, Capacity

ROOM = Capacity(machines=4, memory_mib=1024)
LIVE, GONE = pb.MACHINE_STATE_STARTED, pb.MACHINE_STATE_DESTROYED


def machine(mid: str, key: str = "", state: int = LIVE, memory: int = 256) -> pb.Machine:
    return pb.Machine(
        id=mid, app="web", idempotency_key=key, state=state,  # type: ignore[arg-type]
        config=pb.MachineConfig(guest=pb.GuestConfig(cpu_millicores=100, memory_mib=memory)),
    )  # fmt: skip


def ok(mid: str, key: str, at: float = 1.0) -> Call:
    return Call("create", key, at, "ok", mid)


def test_a_run_that_keeps_every_invariant_passes() -> None:
    history = [ok("w1-a", "k1"), ok("w1-a", "k1", 2.0), Call("destroy", "", 3.0, "ok", "w2-b")]
    held = {
        "w1": {"w1-a": machine("w1-a", "k1")},
        "w2": {"w2-b": machine("w2-b", "k2", GONE)},
    }
    assert checks.disks([*history, ok("w2-b", "k2")], held, ROOM) == []


@pytest.mark.parametrize(
    ("history", "held", "says"),
    [
        (
            [],
            {"w1": {"m": machine("m")}, "w2": {"m": machine("m")}},
            "placement: machine m on w2 and w1",
        ),
        (
            [],
            {"w1": {f"m{i}": machine(f"m{i}") for i in range(5)}},
            "capacity: w1 holds 5 machines and 1280 MiB",
        ),
        (
            [],
            {"w1": {"a": machine("a", memory=2048)}},
            "capacity: w1 holds 1 machines and 2048 MiB",
        ),
        (
            [],
            {"w1": {"a": machine("a", "k1")}, "w2": {"b": machine("b", "k1")}},
            "idempotency: key web/k1 has 2 live machines ['a', 'b']",
        ),
        (
            [ok("a", "k1"), ok("b", "k1")],
            {"w1": {"a": machine("a")}, "w2": {"b": machine("b")}},
            "idempotency: key k1 was answered with live machines ['a', 'b']",
        ),
        ([ok("a", "k1", 4.5)], {"w1": {}}, "durability: create of a (key k1, acknowledged at"),
        (
            [ok("a", "k1")],
            {"w1": {"a": machine("a", "k1", GONE)}},
            "durability: a is destroyed, and nobody asked",
        ),
    ],
    ids=[
        "two-hosts",
        "capacity-count",
        "capacity-memory",
        "key-twice",
        "answered-twice",
        "lost",
        "destroyed-unasked",
    ],
)
def test_a_history_that_breaks_an_invariant_is_caught(
    history: list[Call], held: dict[str, dict[str, pb.Machine]], says: str
) -> None:
    found = checks.disks(history, held, ROOM)
    assert any(v.startswith(says) for v in found), found


def test_liveness_wants_every_worker_seen_alive() -> None:
    alive, dead = platform_pb2.WORKER_STATUS_ALIVE, platform_pb2.WORKER_STATUS_DEAD
    assert checks.liveness(["w1", "w2"], {"w1": alive, "w2": alive}) == []
    assert checks.liveness(["w1", "w2"], {"w1": alive, "w2": dead}) == [
        "liveness: flaps sees worker w2 as WORKER_STATUS_DEAD after healing"
    ]
    assert checks.liveness(["w1", "w2"], {"w1": alive}) == [
        "liveness: flaps does not know worker w2 after healing"
    ]


def on(worker: str, mid: str, state: int = LIVE, instance: str = "i1") -> pb.Machine:
    row = machine(mid, state=state)
    row.worker_id, row.instance_id = worker, instance
    return row


def test_the_replica_must_list_each_workers_live_rows_as_the_worker_has_them() -> None:
    held = {"w1": {"a": on("w1", "a"), "gone": on("w1", "gone", GONE)}, "w2": {}}
    # A destroyed row the worker dropped, or keeps, is nobody's business.
    assert checks.replica(held, [on("w1", "a"), on("w2", "dropped", GONE)]) == []
    assert checks.replica(held, []) == ["replica: flaps does not list a, which w1 has"]
    assert checks.replica(held, [on("w1", "a"), on("w2", "b")]) == [
        "replica: flaps lists b on w2, which has it not"
    ]
    assert checks.replica(held, [on("w1", "a", instance="i0")]) == [
        "replica: flaps lists a as started (instance i0) on w1, its worker has started "
        "(instance i1) on w1"
    ]


def member(mid: str, slot: str, generation: int, primary: str, **fields: object) -> pb.Machine:
    row = machine(mid)
    row.slot.CopyFrom(pb.SlotState(id=slot, generation=generation, primary=primary))
    for name, value in fields.items():
        setattr(row, name, value)
    return row


def test_a_generation_of_a_slot_is_recorded_by_one_member_ever() -> None:
    seen: dict[tuple[str, str, int], set[str]] = {}
    first = {"w2": {"s": member("s", "p", 1, "s")}, "w1": {"p": member("p", "p", 0, "p")}}
    assert checks.promotions(seen, first) == []
    # s is superseded later (its row moves on): what was seen stays seen.
    assert checks.promotions(seen, {"w2": {"s": member("s", "p", 2, "p")}}) == []
    twice = {"w3": {"t": member("t", "p", 1, "t")}}
    assert checks.promotions(seen, twice) == [
        "promotion: generation 1 of slot p was recorded by s, t"
    ]
    assert checks.promotions(seen, twice) == []  # reported once


def test_after_the_calm_each_slot_has_one_serving_member_started_and_unfenced() -> None:
    p, s = member("p", "p", 0, "p"), member("s", "p", 0, "p", state=pb.MACHINE_STATE_STOPPED)
    assert checks.slots({"w1": {"p": p}, "w2": {"s": s}}) == []
    promoted = member("s", "p", 1, "s")
    assert checks.slots({"w1": {"p": p}, "w2": {"s": promoted}}) == [
        "slot p: p runs beside its serving member s"
    ]
    stopped = member("s", "p", 1, "s", state=pb.MACHINE_STATE_STOPPED)
    assert checks.slots(
        {
            "w1": {"p": member("p", "p", 1, "s", state=pb.MACHINE_STATE_STOPPED)},
            "w2": {"s": stopped},
        }
    ) == ["slot p: its serving member s is MACHINE_STATE_STOPPED"]
    lagging = member("p", "p", 1, "s")  # p's row says s serves; s's own row says nobody
    assert checks.slots({"w1": {"p": lagging}, "w2": {"s": s}})[0].startswith(
        "slot p: no member serves"
    )
    fenced = member("p", "p", 0, "p")
    fenced.slot.fenced = True
    assert "slot p: p is still fenced" in checks.slots({"w1": {"p": fenced}, "w2": {"s": s}})
