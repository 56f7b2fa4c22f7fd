"""Slots as tables: who outranks whom, who serves, and the state machine's promotion, fence and
supersede steps (pure: rows built by hand, events applied with `fsm.step`)."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from flyd import fsm
from flyd.fsm import Confirm, Fence, Kill, Op, Spawn, StartRequested, Supersede, UpdateRequested
from flyd.v1 import machine_pb2 as pb
from model import slots
from model.errors import BUSY, STANDBY, SUPERSEDED, FailedPrecondition

S = pb.MachineState
CREATED, STARTED, STOPPED = (
    S.MACHINE_STATE_CREATED,
    S.MACHINE_STATE_STARTED,
    S.MACHINE_STATE_STOPPED,
)
STARTING, STOPPING = S.MACHINE_STATE_STARTING, S.MACHINE_STATE_STOPPING
TERM = int(signal.SIGTERM)
NOW = 1_000.0
H = {"pid": 7, "start_time": 1, "boot_id": "b"}


def machine(mid: str, generation: int = 0, primary: str = "p", *, slot: str = "p") -> pb.Machine:
    return pb.Machine(id=mid, slot=pb.SlotState(id=slot, generation=generation, primary=primary))


def row(
    state: int,
    *,
    me: str = "p",
    generation: int = 0,
    primary: str = "p",
    fenced: bool = False,
    running: bool = False,
    op: Op | None = None,
) -> fsm.Row:
    m = pb.Machine(
        id=me,
        app="app",
        state=state,  # type: ignore[arg-type]
        config=pb.MachineConfig(image="app:v1", standbys=[] if me == "p" else ["p"]),
        slot=pb.SlotState(id="p", generation=generation, primary=primary, fenced=fenced),
    )
    return fsm.Row(m, "sha256:ab", op=op, handle=H if running else None)


def step(r: fsm.Row, event: fsm.Event) -> fsm.Transition | None:
    return fsm.step(r, event, now=NOW, policy=fsm.Policy())


@pytest.mark.parametrize(
    ("a", "b", "outranks"),
    [
        ((1, "s"), (0, "p"), True),  # a higher generation wins, whoever claims it
        ((0, "p"), (1, "s"), False),
        ((1, "a"), (1, "b"), True),  # the same generation: the lower id wins
        ((1, "b"), (1, "a"), False),
        ((1, "a"), (1, "a"), False),  # a claim does not outrank itself
    ],
)
def test_outranks(a: slots.Claim, b: slots.Claim, outranks: bool) -> None:
    assert slots.outranks(a, b) is outranks


def test_who_serves_a_slot() -> None:
    p, s = machine("p"), machine("s")  # the start: both say p serves at generation 0
    assert slots.serving([p, s]) is p
    s1 = machine("s", 1, "s")  # s was promoted
    assert slots.serving([p, s1]) is s1
    assert slots.top([p, s1]) == (1, "s")
    # A row that lags (s stands by for s2 at 2, but s2's own row is not here): nobody serves.
    assert slots.serving([p, machine("s", 2, "s2")]) is None
    assert slots.serving([]) is None
    # Two promotions to one generation (proxies that saw different rows): the lower id serves.
    a, b = machine("a", 1, "a"), machine("b", 1, "b")
    assert slots.serving([b, a]) is a


def test_a_slot_is_one_apps_whatever_id_another_apps_row_names() -> None:
    """Issue 27, attack 1: evil's row names the demo's slot id at a generation far above. It
    is a member of (evil, p), not of the demo's slot: it moves none of the demo's promotions."""
    p, s = machine("p"), machine("s")
    p.app = s.app = "demo"
    evil = machine("e", 1_000_000, "e")
    evil.app = "evil"
    assert slots.key(p) == ("demo", "p") != slots.key(evil) == ("evil", "p")
    assert slots.promotion_generation(s, [p, s, evil]) == 1  # s's own, as without evil
    assert slots.promotion_generation(evil, [p, s, evil]) == 1_000_001  # alone in its slot


def test_a_row_without_a_slot_gets_the_one_its_create_would_give() -> None:
    standby = pb.Machine(id="s", config=pb.MachineConfig(standbys=["p"]))
    assert slots.slot_of(standby) == pb.SlotState(id="p", generation=0, primary="p")
    assert not slots.is_primary(standby)
    alone = pb.Machine(id="a")
    assert slots.slot_of(alone) == pb.SlotState(id="a", generation=0, primary="a")
    assert slots.is_primary(alone)


def test_a_standby_is_created_stopped_and_starts_only_when_promoted() -> None:
    m = pb.Machine(id="s", config=pb.MachineConfig(image="app:v1", standbys=["p"]))
    first = fsm.create(m, image_digest="sha256:ab", skip_launch=False, now=NOW)
    assert first.row.op is None  # no start pending, whatever skip_launch said
    assert first.row.machine.slot == pb.SlotState(id="p", generation=0, primary="p")
    with pytest.raises(FailedPrecondition, match="stands by for p") as err:
        step(first.row, StartRequested())
    assert err.value.reason == STANDBY
    promoted = step(first.row, StartRequested(1))
    assert promoted is not None
    assert (promoted.type, promoted.to_state, promoted.effects) == ("promote", STARTING, (Spawn(),))
    assert promoted.row.machine.slot == pb.SlotState(id="p", generation=1, primary="s")
    assert "promoted to generation 1" in promoted.reason


@pytest.mark.parametrize(
    ("r", "generation", "outcome"),
    [
        # a repeat of its own promotion, or a stale one, is a plain (idempotent) start
        (row(STARTED, me="s", generation=1, primary="s", running=True), 1, None),
        (row(STARTED, me="s", generation=2, primary="s", running=True), 1, None),
        # the slot holds that generation (or a higher one) for another member
        (row(STOPPED, me="s", generation=1, primary="s2"), 1, SUPERSEDED),
        (row(STOPPED, me="s", generation=2, primary="p"), 1, SUPERSEDED),
        # a fenced primary that is promoted keeps running: only its claim changes
        (row(STARTED, generation=0, fenced=True, running=True), 1, "promote"),
        (row(STOPPING, me="s", running=True), 1, BUSY),
    ],
)
def test_promotions(r: fsm.Row, generation: int, outcome: str | None) -> None:
    if outcome in (SUPERSEDED, BUSY):
        with pytest.raises(FailedPrecondition) as err:
            step(r, StartRequested(generation))
        assert err.value.reason == outcome
        return
    t = step(r, StartRequested(generation))
    if outcome is None:
        assert t is None
        return
    assert t is not None
    assert (t.type, t.to_state, t.effects) == ("promote", STARTED, ())
    assert t.row.machine.slot == pb.SlotState(
        id="p", generation=generation, primary=r.machine.id, fenced=False
    )


def test_a_fence_is_put_on_a_serving_primary_and_lifted_at_its_generation() -> None:
    r = row(STARTED, running=True)
    fenced = step(r, Fence("flyd started again"))
    assert fenced is not None
    assert (fenced.type, fenced.to_state, fenced.effects) == ("fence", STARTED, ())
    assert fenced.row.machine.slot.fenced
    assert step(fenced.row, Fence("again")) is None  # once is enough
    assert step(row(STOPPED, me="s"), Fence("x")) is None  # a standby serves nothing
    assert step(fenced.row, Confirm(3)) is None  # the claim changed meanwhile: not this one
    lifted = step(fenced.row, Confirm(0))
    assert lifted is not None
    assert not lifted.row.machine.slot.fenced
    assert "no member of its slot outranks generation 0" in lifted.reason


def test_an_outranked_primary_stops_and_stands_by() -> None:
    r = row(STARTED, running=True, fenced=True)
    t = step(r, Supersede(1, "s", TERM, 5.0))
    assert t is not None
    assert (t.type, t.to_state, t.effects) == ("supersede", STOPPING, (Kill(TERM, 5.0),))
    assert t.row.machine.slot == pb.SlotState(id="p", generation=1, primary="s", fenced=False)
    assert t.row.op == Op("stop", "kill", signal=TERM, timeout=5.0)
    assert "s serves slot p at generation 1" in t.reason
    # a claim that does not outrank changes nothing
    assert step(r, Supersede(0, "q")) is None
    assert step(r, Supersede(1, "p")) is None  # (its own id)
    # a stopped copy only learns who serves now
    quiet = step(row(STOPPED), Supersede(2, "s"))
    assert quiet is not None
    assert (quiet.to_state, quiet.effects) == (STOPPED, ())
    # so does a standby
    standby = step(row(STOPPED, me="s2", generation=1, primary="s"), Supersede(2, "x"))
    assert standby is not None
    assert standby.row.machine.slot.primary == "x"


def test_a_standby_is_updated_only_stopped() -> None:
    update = UpdateRequested(
        config=pb.MachineConfig(image="app:v2", standbys=["p"]),
        instance_id="i2",
        image_digest="sha256:cd",
        ports=(),
        launch=True,
        stop_signal=TERM,
        stop_timeout=1.0,
    )
    with pytest.raises(FailedPrecondition) as err:
        step(row(STOPPED, me="s"), update)
    assert err.value.reason == STANDBY
    kept = step(row(STOPPED, me="s"), dataclasses.replace(update, launch=False))
    assert kept is not None
    assert kept.to_state == STOPPED
