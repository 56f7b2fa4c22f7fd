"""Slots: a primary and the machines standing by for it, and which member may serve.

Each member's row carries a `SlotState` (flyd.v1): the slot's id, the highest generation its
worker recorded, and the member that serves at that generation as far as the row knows. A
member's claim is (generation, primary); a claim outranks another when its generation is higher,
or equal with a lower primary id (two promotions to one generation can only happen when proxies
saw different rows; the lower id wins, deterministically). The member that serves is the one
whose own row holds the claim no other row outranks. Pure functions, no I/O: flyd writes each
member's row from them, and flaps and the proxy read them (docs/fencing.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from flyd.v1 import machine_pb2 as pb

Claim = tuple[int, str]
"""(generation, primary): who serves the slot at which generation, as one row knows it."""


def new_slot(machine_id: str, config: pb.MachineConfig) -> pb.SlotState:
    """A new machine's slot: the first machine it stands by for, or its own (generation 0)."""
    first = config.standbys[0] if config.standbys else machine_id
    return pb.SlotState(id=first, generation=0, primary=first)


def slot_of(machine: pb.Machine) -> pb.SlotState:
    """The machine's slot; derived from its config when its row has none (written before slots
    existed, or a test's row)."""
    if machine.slot.id:
        return machine.slot
    return new_slot(machine.id, machine.config)


def claim(machine: pb.Machine) -> Claim:
    slot = slot_of(machine)
    return slot.generation, slot.primary


def outranks(a: Claim, b: Claim) -> bool:
    """Whether claim `a` beats claim `b`: a higher generation, or the same with a lower id."""
    return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


def is_primary(machine: pb.Machine) -> bool:
    """Whether the machine's own row says it serves its slot (at the generation it records)."""
    return slot_of(machine).primary == machine.id


def top(members: Iterable[pb.Machine]) -> Claim | None:
    """The claim no member's row outranks (None for no members)."""
    best: Claim | None = None
    for m in members:
        c = claim(m)
        if best is None or outranks(c, best):
            best = c
    return best


def serving(members: Iterable[pb.Machine]) -> pb.Machine | None:
    """The member that may serve: its own row holds the top claim. None when no row does (the
    slot's primary is not among `members`, or its row lags behind another's claim)."""
    rows = list(members)
    best = top(rows)
    if best is None:
        return None
    for m in rows:
        if m.id == best[1] and claim(m) == best:
            return m
    return None


def with_slot(machine: pb.Machine, slot: pb.SlotState) -> pb.Machine:
    """A copy of the machine with `slot` in place of its own."""
    out = pb.Machine()
    out.CopyFrom(machine)
    out.slot.CopyFrom(slot)
    return out
