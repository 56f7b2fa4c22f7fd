"""Slots: a primary and the machines standing by for it, and which member may serve.

Each member's row carries a `SlotState` (flyd.v1): the slot's id, the highest generation its
worker recorded, and the member that serves at that generation as far as the row knows. A
member's claim is (generation, primary); a claim outranks another when its generation is higher,
or equal with a lower primary id. The member that serves is the one whose own row holds the
claim no other row outranks. Each generation belongs to one member (`promotion_generation`),
so two promoters never record two promotions at one generation, however their views differ.
A slot is one app's: its members are the machines of one app whose rows name one slot id
(`key`). A machine of another app that names the same id (its config says it stands by for a
machine it may not touch) is in a slot of its own app's, and no claim of it counts in the
other's. Pure functions, no I/O: flyd writes each member's row from them, and flaps and the
proxy read them (docs/fencing.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from flyd.v1 import machine_pb2 as pb
from model.errors import STANDBY, SUPERSEDED, FailedPrecondition

Claim = tuple[int, str]
"""(generation, primary): who serves the slot at which generation, as one row knows it."""
SlotKey = tuple[str, str]
"""(app, slot id): which slot a machine is a member of."""


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


def key(machine: pb.Machine) -> SlotKey:
    """The slot the machine is a member of: its app's slot of the id its row names. Whoever
    groups rows into slots (the proxy's index, a returning worker's fence, promotions) groups
    by this, so another app's row naming the same id is never counted a member."""
    return machine.app, slot_of(machine).id


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


def order(slot: str, member_ids: Iterable[str]) -> list[str]:
    """The slot's members in their fixed order: its first primary (the slot's id) first, the
    others by id. A member's place in it says which generations are its own."""
    ids = set(member_ids)
    return ([slot] if slot in ids else []) + sorted(ids - {slot})


def promotion_generation(member: pb.Machine, members: Iterable[pb.Machine]) -> int:
    """The generation `member` is promoted to: the lowest above every claim of the slot's rows
    that is its own. Generation g belongs to the member at place g mod n of `order` (n
    members), so two promotions naming one generation promote one member, whatever the
    promoters believed about workers or which standby they tried first (docs/fencing.md)."""
    slot, mine = slot_of(member).id, key(member)
    rows = [m for m in members if key(m) == mine and m.id != member.id]
    ids = order(slot, [member.id, *(m.id for m in rows)])
    place, n = ids.index(member.id), len(ids)
    best = top([member, *rows])
    above = (best[0] if best is not None else 0) + 1
    return above + (place - above) % n


def owner(generation: int, slot: str, member_ids: Iterable[str]) -> str:
    """The member whose own generation `generation` is (see `promotion_generation`)."""
    ids = order(slot, member_ids)
    return ids[generation % len(ids)]


def with_slot(machine: pb.Machine, slot: pb.SlotState) -> pb.Machine:
    """A copy of the machine with `slot` in place of its own."""
    out = pb.Machine()
    out.CopyFrom(machine)
    out.slot.CopyFrom(slot)
    return out


# -- the claim a step of the state machine (flyd.fsm) gives a row; None: it keeps its own ------


def promotion(machine: pb.Machine, generation: int) -> pb.SlotState | None:
    """The slot a start naming `generation` gives the machine: None for a plain start (0, or a
    repeated or stale promotion of the slot's primary). A plain start of a standby is refused
    (STANDBY), and so is a promotion to a generation the slot holds already (SUPERSEDED)."""
    me, slot = machine.id, slot_of(machine)
    if generation == 0 or (slot.primary == me and generation <= slot.generation):
        if slot.primary != me:
            raise FailedPrecondition(
                f"machine {me} stands by for {slot.primary} in slot {slot.id} (generation "
                f"{slot.generation}); it starts only when promoted to a higher generation",
                STANDBY,
            )
        return None
    if generation <= slot.generation:
        raise FailedPrecondition(
            f"slot {slot.id} is at generation {slot.generation}, served by {slot.primary}; "
            f"a promotion of {me} must name a higher one than {generation}",
            SUPERSEDED,
        )
    return pb.SlotState(id=slot.id, generation=generation, primary=me)


def fenced(machine: pb.Machine) -> pb.SlotState | None:
    """A primary's slot, fenced (its worker came back); None for a standby or a fenced one."""
    slot = slot_of(machine)
    if slot.fenced or slot.primary != machine.id:
        return None
    return pb.SlotState(id=slot.id, generation=slot.generation, primary=slot.primary, fenced=True)


def lifted(machine: pb.Machine, generation: int) -> pb.SlotState | None:
    """The fence lifted, when the claim is still the one confirmed at `generation`."""
    slot = slot_of(machine)
    if not slot.fenced or slot.generation != generation or slot.primary != machine.id:
        return None  # lifted already, or the claim changed while it was being confirmed
    return pb.SlotState(id=slot.id, generation=slot.generation, primary=slot.primary)


def superseded(machine: pb.Machine, generation: int, primary: str) -> pb.SlotState | None:
    """The slot once `primary` serves it at `generation`, when that outranks the row's claim."""
    slot = slot_of(machine)
    if primary == machine.id or not outranks((generation, primary), claim(machine)):
        return None
    return pb.SlotState(id=slot.id, generation=generation, primary=primary)
