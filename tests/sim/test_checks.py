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
