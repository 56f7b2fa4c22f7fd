"""Who may pin a request to one machine (`nonomad-force-instance-id`): whoever sends, in
`nonomad-token`, a token (model.tokens) that may read the app and that machine.

The proxy holds no root keys: with macaroons, a key that verifies also mints, and the edge is
the part most exposed. It asks flaps instead (flaps.v1.TokenService, on flaps' cluster port,
with its certificate: `Grants`), and keeps each answer for `ttl` seconds by the token's
SHA-256, at most `keep` of them: a token revoked at flaps stops pinning within `ttl`, one that
expires stops at once (its expiry comes with its grant), and a flood of one bad token costs
flaps one call per `ttl`. Without flaps (or while it does not answer) no request is pinned.
docs/auth.md says why this rather than a key of the proxy's own.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import structlog

from flaps.v1 import tokens_pb2
from model.tokens import Caveat, Denied, Grant
from proxy.control import FlapsFailed
from runtime.clock import Clock, SystemClock

__all__ = ["GRANT_KEEP", "GRANT_TTL", "Grants", "PinCheck", "pin_check"]

log = structlog.get_logger("proxy.pins")

GRANT_TTL = 5.0
"""Seconds an answer of flaps about a token is used: how late a revocation may be honoured."""
GRANT_KEEP = 4096
"""Answers kept at most (the oldest goes first)."""

PinCheck = Callable[[str, str, bytes | None], Awaitable[str | None]]
"""(app, machine id, the nonomad-token header or None) -> None if allowed, else why not."""
Verify = Callable[[str], Awaitable[tokens_pb2.VerifyTokenResponse]]
"""Asks flaps about a token (proxy.control.FlapsClient.verify_token); raises FlapsFailed."""


class Grants:
    """Tokens' grants as flaps answers them (`verify`), kept `ttl` seconds by digest.

    `grant(token)` is the token's Grant, or a string saying why it is not valid (or why it
    could not be verified now: that answer is not kept). Callers asking about one token at
    once share one call to flaps.
    """

    def __init__(
        self,
        verify: Verify,
        *,
        ttl: float = GRANT_TTL,
        keep: int = GRANT_KEEP,
        clock: Clock | None = None,
    ) -> None:
        self._verify = verify
        self.ttl = ttl
        self.keep = keep
        self.clock = clock or SystemClock()
        self._known: OrderedDict[bytes, tuple[float, Grant | str]] = OrderedDict()
        self._asking: dict[bytes, asyncio.Future[Grant | str]] = {}

    def __len__(self) -> int:
        return len(self._known)

    async def grant(self, token: str) -> Grant | str:
        digest = hashlib.sha256(token.strip().encode()).digest()
        now = self.clock.now()
        known = self._known.get(digest)
        if known is not None and now - known[0] < self.ttl:
            return self._still_valid(known[1], now)
        asking = self._asking.get(digest)
        if asking is None:
            asking = asyncio.ensure_future(self._ask(digest, token))
            self._asking[digest] = asking
            asking.add_done_callback(lambda _: self._asking.pop(digest, None))
        return self._still_valid(await asyncio.shield(asking), self.clock.now())

    async def _ask(self, digest: bytes, token: str) -> Grant | str:
        fetched = self.clock.now()
        try:
            answer = await self._verify(token)
        except FlapsFailed as err:
            log.warning("token_unverified", reason=str(err))
            return f"the token cannot be verified now ({err})"
        got: Grant | str
        if answer.refused:
            got = answer.refused
        else:
            try:
                got = Grant(answer.token_id, tuple(Caveat.parse(c) for c in answer.caveats))
            except ValueError as err:  # a caveat this proxy does not know: fail closed
                got = f"token {answer.token_id}: {err}"
        self._known.pop(digest, None)
        while len(self._known) >= self.keep:
            self._known.popitem(last=False)
        self._known[digest] = (fetched, got)
        return got

    @staticmethod
    def _still_valid(got: Grant | str, now: float) -> Grant | str:
        if isinstance(got, Grant) and got.expires and now >= got.expires:
            return f"token {got.token_id} has expired"
        return got


def pin_check(grants: Grants | None) -> PinCheck:
    """The check of a pinned request, with the grants flaps gives (None: no flaps)."""

    async def check(app: str, machine_id: str, token: bytes | None) -> str | None:
        if grants is None:
            return "this proxy has no flaps to verify tokens with: it pins no requests"
        if token is None:
            return (
                f"pinning a machine needs a nonomad-token header with a token that may read "
                f"app {app}"
            )
        got = await grants.grant(token.decode("latin-1"))
        if isinstance(got, str):
            return f"nonomad-token: {got}"
        try:
            got.check(("read",), app, machine_id)
        except Denied as err:
            return f"nonomad-token: {err}"
        return None

    return check
