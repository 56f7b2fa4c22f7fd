"""The invariants a run must keep, checked over what it recorded: the history of every call
the cluster's users made (Jepsen's invoke and ok / fail / unknown) and the rows every disk
holds at the end. Pure functions of those, so that each can be shown to fail on a history
that breaks it (tests/sim/test_checks.py)."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from model import slots as slot_rules


@dataclass
class Call:
    """One operation in the history."""

    op: str  # create | destroy
    key: str
    invoked: float
    outcome: str = "pending"  # ok | fail (nothing happened) | unknown (it may have)
    machine_id: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Capacity:
    machines: int
    memory_mib: int


def disks(
    history: Sequence[Call],
    held: Mapping[str, Mapping[str, pb.Machine]],
    capacity: Capacity,
) -> list[str]:
    """`held`: each host's machines by id, as its disk has them.

    - a machine is on one host only;
    - no host holds more than its capacity (machines, memory) in machines not destroyed;
    - one live machine per idempotency key, and no two live machines answered for one key;
    - every acknowledged create is on a disk, and not destroyed unless a destroy was asked.
    """
    found: list[str] = []
    where: dict[str, str] = {}
    live: dict[str, pb.Machine] = {}
    for host, machines in sorted(held.items()):
        for machine_id, machine in machines.items():
            if machine_id in where:
                found.append(f"placement: machine {machine_id} on {host} and {where[machine_id]}")
            where[machine_id] = host
            if machine.state != pb.MACHINE_STATE_DESTROYED:
                live[machine_id] = machine
        kept = [m for m in machines.values() if m.state != pb.MACHINE_STATE_DESTROYED]
        memory = sum(m.config.guest.memory_mib for m in kept)
        if len(kept) > capacity.machines or memory > capacity.memory_mib:
            found.append(
                f"capacity: {host} holds {len(kept)} machines and {memory} MiB "
                f"(it has room for {capacity.machines}, {capacity.memory_mib} MiB)"
            )
    by_key: dict[str, list[str]] = collections.defaultdict(list)
    for machine_id, machine in sorted(live.items()):
        if machine.idempotency_key:
            by_key[f"{machine.app}/{machine.idempotency_key}"].append(machine_id)
    for key, ids in sorted(by_key.items()):
        if len(ids) > 1:
            found.append(f"idempotency: key {key} has {len(ids)} live machines {ids}")
    asked_to_destroy = {c.machine_id for c in history if c.op == "destroy"}
    answered: dict[str, set[str]] = collections.defaultdict(set)
    for call in history:
        if call.op != "create" or call.outcome != "ok":
            continue
        answered[call.key].add(call.machine_id)
        if call.machine_id not in where:
            found.append(
                f"durability: create of {call.machine_id} (key {call.key}, acknowledged at "
                f"t={call.invoked:.3f}s) is on no disk"
            )
        elif call.machine_id not in live and call.machine_id not in asked_to_destroy:
            found.append(f"durability: {call.machine_id} is destroyed, and nobody asked")
    for key, told in sorted(answered.items()):
        alive = sorted(m for m in told if m in live)
        if len(alive) > 1:
            found.append(f"idempotency: key {key} was answered with live machines {alive}")
    return found


def liveness(hosts: Sequence[str], seen: Mapping[str, int]) -> list[str]:
    """Once every fault has healed and the calm has run, flaps sees every worker alive.
    `seen`: the workers flaps lists, with their `flaps.v1.WorkerStatus`."""
    found = []
    for host in hosts:
        if host not in seen:
            found.append(f"liveness: flaps does not know worker {host} after healing")
        elif seen[host] != platform_pb2.WORKER_STATUS_ALIVE:
            status = platform_pb2.WorkerStatus.Name(seen[host])  # type: ignore[arg-type]
            found.append(f"liveness: flaps sees worker {host} as {status} after healing")
    return found


def replica(
    held: Mapping[str, Mapping[str, pb.Machine]], listed: Sequence[pb.Machine]
) -> list[str]:
    """Once every fault has healed and the calm has run, flaps' replica has every worker's
    machines as the worker has them (state, instance, worker), and no machine alive that no
    worker has alive. `held`: each worker's rows, from the worker itself; `listed`: what flaps
    lists. Destroyed rows are left out: a worker drops them when it pleases, and no event says
    so (the replica keeps the last row it was sent)."""
    found: list[str] = []
    truth = {
        machine_id: (worker, m.state, m.instance_id)
        for worker, machines in held.items()
        for machine_id, m in machines.items()
        if m.state != pb.MACHINE_STATE_DESTROYED
    }
    seen = {
        m.id: (m.worker_id, m.state, m.instance_id)
        for m in listed
        if m.state != pb.MACHINE_STATE_DESTROYED
    }
    for machine_id in sorted(truth.keys() | seen.keys()):
        want, got = truth.get(machine_id), seen.get(machine_id)
        if want == got:
            continue
        if got is None:
            assert want is not None
            found.append(f"replica: flaps does not list {machine_id}, which {want[0]} has")
        elif want is None:
            found.append(f"replica: flaps lists {machine_id} on {got[0]}, which has it not")
        else:
            found.append(
                f"replica: flaps lists {machine_id} as {_row(got)}, its worker has {_row(want)}"
            )
    return found


def _row(row: tuple[str, int, str]) -> str:
    worker, state, instance = row
    name = pb.MachineState.Name(state).removeprefix("MACHINE_STATE_").lower()  # type: ignore[arg-type]
    return f"{name} (instance {instance}) on {worker}"


def promotions(
    seen: dict[tuple[str, str, int], set[str]], held: Mapping[str, Mapping[str, pb.Machine]]
) -> list[str]:
    """At most one promotion per generation of a slot, ever. `seen` (kept from call to call):
    for each (app, slot, generation), the members whose own row claimed it for themselves;
    `held`: every worker's rows now. Each member that makes a generation's second is reported
    once."""
    found = []
    for machines in held.values():
        for m in machines.values():
            slot = slot_rules.slot_of(m)
            if slot.generation == 0 or slot.primary != m.id:
                continue
            members = seen.setdefault((m.app, slot.id, slot.generation), set())
            if m.id in members:
                continue
            members.add(m.id)
            if len(members) > 1:
                found.append(
                    f"promotion: generation {slot.generation} of slot {slot.id} was recorded "
                    f"by {', '.join(sorted(members))}"
                )
    return found


def slots(held: Mapping[str, Mapping[str, pb.Machine]]) -> list[str]:
    """Once every fault has healed and the calm has run, each slot with more than one member
    has one serving (its own row holds the top claim), started and unfenced, and every other
    member is not running; and no member of any slot is fenced."""
    found: list[str] = []
    members: dict[tuple[str, str], list[pb.Machine]] = collections.defaultdict(list)
    for machines in held.values():
        for m in machines.values():
            if m.state != pb.MACHINE_STATE_DESTROYED:
                members[slot_rules.key(m)].append(m)
    for (_, slot), rows in sorted(members.items()):
        for m in rows:
            if m.slot.fenced:
                found.append(f"slot {slot}: {m.id} is still fenced")
        if len(rows) < 2:
            continue
        serving = slot_rules.serving(rows)
        if serving is None:
            claims = ", ".join(f"{m.id} {tuple(slot_rules.claim(m))}" for m in rows)
            found.append(f"slot {slot}: no member serves (claims: {claims})")
            continue
        if serving.state != pb.MACHINE_STATE_STARTED:
            state = pb.MachineState.Name(serving.state)
            found.append(f"slot {slot}: its serving member {serving.id} is {state}")
        for m in rows:
            if m.id != serving.id and m.state in RUNNING:
                found.append(f"slot {slot}: {m.id} runs beside its serving member {serving.id}")
    return found


RUNNING = (pb.MACHINE_STATE_STARTING, pb.MACHINE_STATE_STARTED)
