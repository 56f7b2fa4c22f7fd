"""The edge checks a pin's token with what flaps says of it (proxy.pins.Grants): it holds no
root keys, keeps each answer `ttl` seconds (the clock a ManualClock here), and so honours a
revocation within `ttl` and an expiry at once.

flaps' side is its own TokenServicer over a keyring and a revocation list the test changes
(tests/proxy/support.py: flaps_verifies); a counter says how often it was asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from flaps.v1 import tokens_pb2
from model.tokens import Grant, Keyring, inspect, new_key_line
from proxy.control import FlapsFailed
from proxy.pins import Grants, pin_check
from runtime.clock import ManualClock
from tests.proxy.support import flaps_verifies

KEYS = Keyring.parse(new_key_line("k1"))
NOW = 1_800_000_000.0
TTL = 5.0


class Flaps:
    """flaps as the proxy reaches it: its answers, how many it gave, and whether it answers."""

    def __init__(self, keys: Keyring = KEYS) -> None:
        self.revoked: frozenset[str] = frozenset()
        self.asked = 0
        self.down = False
        self.gate: asyncio.Event | None = None
        self._verify = flaps_verifies(keys, lambda: self.revoked)

    async def verify(self, token: str) -> tokens_pb2.VerifyTokenResponse:
        self.asked += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise FlapsFailed("flaps: UNAVAILABLE: connection refused")
        return await self._verify(token)


def grants(flaps: Flaps, clock: ManualClock, keep: int = 100) -> Grants:
    return Grants(flaps.verify, ttl=TTL, keep=keep, clock=clock)


def reader(expires: float = NOW + 3600) -> str:
    return KEYS.mint(["apps = web", "ops = read", f"expires = {int(expires)}"])


async def test_a_revoked_token_stops_pinning_within_the_ttl() -> None:
    clock, flaps = ManualClock(NOW), Flaps()
    check = pin_check(grants(flaps, clock))
    token = reader()
    assert await check("web", "m-1", token.encode()) is None
    flaps.revoked = frozenset({inspect(token).token_id})  # at flaps, now
    clock.advance(TTL - 0.5)
    assert await check("web", "m-1", token.encode()) is None  # the answer kept: still honoured
    assert flaps.asked == 1
    clock.advance(0.5)
    refused = await check("web", "m-1", token.encode())
    assert refused == f"nonomad-token: token {inspect(token).token_id} was revoked"
    assert flaps.asked == 2


async def test_an_expired_token_stops_pinning_at_once_whatever_is_kept() -> None:
    clock, flaps = ManualClock(NOW), Flaps()
    check = pin_check(grants(flaps, clock))
    token = reader(expires=NOW + 1)
    assert await check("web", "m-1", token.encode()) is None
    clock.advance(1)
    assert await check("web", "m-1", token.encode()) == (
        f"nonomad-token: token {inspect(token).token_id} has expired"
    )
    assert flaps.asked == 1  # known, and refused without asking again


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: "garbage", "not a nonomad token"),
        (lambda: Keyring.parse(new_key_line("k1")).mint([], now=NOW), "bad signature"),
        (lambda: KEYS.mint(["apps = api"], now=NOW), 'caveat "apps = api" does not allow app web'),
        (lambda: KEYS.mint(["apps = web", "ops = stop"], now=NOW), 'caveat "ops = stop"'),
        (lambda: KEYS.mint(["machines = m-2"], now=NOW), 'caveat "machines = m-2" does not'),
    ],
)
async def test_a_bad_token_is_refused_and_asked_about_once_per_ttl(
    make: Callable[[], str], words: str
) -> None:
    clock, flaps = ManualClock(NOW), Flaps()
    check = pin_check(grants(flaps, clock))
    token = make()
    for _ in range(3):  # a client repeating it costs flaps nothing more
        refused = await check("web", "m-1", token.encode())
        assert refused is not None
        assert words in refused, refused
    assert flaps.asked == 1


async def test_flaps_not_answering_refuses_the_pin_and_keeps_nothing() -> None:
    clock, flaps = ManualClock(NOW), Flaps()
    kept = grants(flaps, clock)
    check = pin_check(kept)
    flaps.down = True
    refused = await check("web", "m-1", reader().encode())
    assert refused is not None
    assert "cannot be verified now" in refused
    assert len(kept) == 0
    flaps.down = False
    assert await check("web", "m-1", reader().encode()) is None


async def test_callers_asking_about_one_token_at_once_share_one_call() -> None:
    clock, flaps = ManualClock(NOW), Flaps()
    kept = grants(flaps, clock)
    flaps.gate = asyncio.Event()
    token = reader()
    waiting: list[Awaitable[Grant | str]] = [kept.grant(token) for _ in range(5)]
    tasks = [asyncio.ensure_future(w) for w in waiting]
    await asyncio.sleep(0)
    flaps.gate.set()
    got = await asyncio.gather(*tasks)
    assert flaps.asked == 1
    assert {g.token_id for g in got if isinstance(g, Grant)} == {inspect(token).token_id}


async def test_the_answers_kept_are_bounded() -> None:
    clock, flaps = ManualClock(NOW), Flaps()
    kept = grants(flaps, clock, keep=3)
    tokens = [reader() for _ in range(10)]
    for token in tokens:
        assert isinstance(await kept.grant(token), Grant)
    assert len(kept) == 3
    await kept.grant(tokens[-1])  # among the newest: kept
    assert flaps.asked == 10
    await kept.grant(tokens[0])  # the oldest went first: asked again
    assert flaps.asked == 11


async def test_without_a_token_or_without_flaps_nothing_is_pinned() -> None:
    clock, flaps = ManualClock(NOW), Flaps()
    missing = await pin_check(grants(flaps, clock))("web", "m-1", None)
    assert missing is not None
    assert "needs a nonomad-token header" in missing
    nobody = await pin_check(None)("web", "m-1", reader().encode())
    assert nobody is not None
    assert "no flaps" in nobody
    assert flaps.asked == 0
