"""The edge's side of fencing (docs/fencing.md): which member of each slot gets requests.

A slot's members are the routes of one app whose rows name the same slot (`model.slots.key`:
another app's machine naming the slot's id is in a slot of its own app's, and its claims never
count here, however high). Only the member whose own row holds the slot's top claim, the
serving one, is routed to; the others are standbys or outranked copies. `SlotIndex` keeps
each slot's members and re-judges a slot when one of its rows changes: it marks every member
serving or not, and says which routes just stopped serving (their requests in flight end: a
GET is sent again, to the new primary once it is up) and which outranked copies still run
unfenced (their workers are told, through flaps, to stop them: `proxy.router.Router` does
both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flyd.v1 import machine_pb2 as pb
from model import slots
from proxy.control import RUNNING
from proxy.routes import Route

S = pb.MachineState


@dataclass
class Judged:
    """What re-judging one slot found."""

    top: slots.Claim | None = None
    """The claim no member outranks: (generation, primary)."""
    serving: Route | None = None
    """The member that serves (None: no row of the slot holds the top claim)."""
    demoted: list[Route] = field(default_factory=list)
    """Started members that served until now and no longer do."""
    outranked: list[Route] = field(default_factory=list)
    """Members that still run as unfenced primaries of a claim the top outranks."""


class SlotIndex:
    """Each slot's members among the routes, and which of them serves."""

    def __init__(self) -> None:
        self._members: dict[slots.SlotKey, dict[str, Route]] = {}

    def place(self, r: Route) -> slots.SlotKey | None:
        """Index `r` under the slot its row names now; the slot it left, if it moved (only a
        row from before slots and then one with them can: flyd never moves a machine)."""
        slot = slots.key(r.machine)
        left = None
        if r.slot and r.slot != slot:
            left = r.slot
            self.remove(r)
        r.slot = slot
        self._members.setdefault(slot, {})[r.id] = r
        return left

    def remove(self, r: Route) -> None:
        if r.slot is None:
            return
        members = self._members.get(r.slot)
        if members is not None:
            members.pop(r.id, None)
            if not members:
                del self._members[r.slot]

    def members(self, slot: slots.SlotKey | None) -> list[Route]:
        if slot is None:
            return []
        return list(self._members.get(slot, {}).values())

    def promotion_generation(self, r: Route) -> int:
        """The generation `r` is promoted to, its own (model.slots.promotion_generation)."""
        return slots.promotion_generation(r.machine, [o.machine for o in self.members(r.slot)])

    def slots_of(self, routes: list[Route]) -> set[slots.SlotKey]:
        return {r.slot for r in routes if r.slot is not None and r.slot in self._members}

    def judge(self, slot: slots.SlotKey) -> Judged:
        """Mark the members of `slot` serving or not; see `Judged`."""
        members = self.members(slot)
        if not members:
            return Judged()
        rows = [r.machine for r in members]
        best = slots.top(rows)
        serving = slots.serving(rows)
        out = Judged(top=best)
        for r in members:
            was = r.serving
            r.serving = serving is not None and r.id == serving.id
            if r.serving:
                out.serving = r
            r.peers = len(members) - 1
            if was and not r.serving and r.state == S.MACHINE_STATE_STARTED:
                out.demoted.append(r)
            machine = r.machine
            if (
                not r.serving
                and best is not None
                and machine.state in RUNNING
                and slots.is_primary(machine)
                and not machine.slot.fenced
                and slots.outranks(best, slots.claim(machine))
            ):
                out.outranked.append(r)
        return out
