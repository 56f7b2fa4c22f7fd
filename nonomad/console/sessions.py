"""The console's sessions and one-time login codes, held in this process only.

A session is what a login opens: a random id (the cookie's value; it is kept here by its
SHA-256, so the store holds no usable cookie), the operator's token (the console's calls to
flaps for it carry that token), its scope, and three ends: `ttl` after the login, `idle`
after its last request, and never past the token's own expiry. The token is checked through
flaps again every `recheck` seconds while the session is used, so a revoked or rotated-away
token ends its sessions within that. A logout, an expiry, an eviction (the store keeps at most
`max_sessions`; the least recently used goes) or the console's shutdown sets the session's
`ended`, which ends its open streams.

A login code is what `nonomad up` prints: a random code that stands, once and for
`code_ttl` seconds, for a token the console verified when the code was asked for. The code
is in the URL; the token never is.

Time comes from `clock` (seconds): tests pass a ManualClock's `now`.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from nonomad.client import Client
from nonomad.console.access import Scope

__all__ = ["LoginCodes", "Session", "Sessions"]

SESSION_TTL = 12 * 3600.0
SESSION_IDLE = 3600.0
RECHECK = 15.0
MAX_SESSIONS = 256
CODE_TTL = 300.0
MAX_CODES = 64
STREAMS_PER_SESSION = 16
"""Live streams (page updates and logs) one session may hold open at once."""


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


@dataclass(eq=False)
class Session:
    """One operator logged in (see the module docstring)."""

    token: str = field(repr=False)
    scope: Scope
    flaps: Client = field(repr=False)
    """flaps, called with this session's token."""
    created: float
    expires: float
    """When it ends whatever happens: `ttl` after the login, or the token's expiry."""
    last_seen: float
    checked: float
    """When flaps last said the token was good."""
    csrf: str = field(repr=False, default_factory=lambda: secrets.token_urlsafe(24))
    """The logout form's token (a cross-site page cannot read it)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    streams: int = 0
    """Its live streams open now, at most `stream_cap`."""
    stream_cap: int = STREAMS_PER_SESSION
    checking: asyncio.Lock = field(default_factory=asyncio.Lock)

    def end(self) -> None:
        self.ended.set()


class Sessions:
    """The bounded store of sessions (see the module docstring)."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        ttl: float = SESSION_TTL,
        idle: float = SESSION_IDLE,
        recheck: float = RECHECK,
        max_sessions: int = MAX_SESSIONS,
        streams_per_session: int = STREAMS_PER_SESSION,
    ) -> None:
        if min(ttl, idle, recheck) <= 0 or max_sessions < 1 or streams_per_session < 1:
            raise ValueError("Sessions: ttl, idle and recheck must be > 0, the maxima >= 1")
        self.clock = clock
        self.ttl = ttl
        self.idle = idle
        self.recheck = recheck
        self.max_sessions = max_sessions
        self.streams_per_session = streams_per_session
        self._by_digest: collections.OrderedDict[bytes, Session] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._by_digest)

    def open(self, token: str, scope: Scope, flaps: Client) -> tuple[str, Session]:
        """A new session for a verified token: (its id, for the cookie, and the session)."""
        now = self.clock()
        expires = now + self.ttl
        if scope.expires:
            expires = min(expires, float(scope.expires))
        session = Session(token, scope, flaps, now, expires, now, now)
        session.stream_cap = self.streams_per_session
        session_id = secrets.token_urlsafe(32)
        self._by_digest[_digest(session_id)] = session
        while len(self._by_digest) > self.max_sessions:
            _, oldest = self._by_digest.popitem(last=False)
            oldest.end()
        return session_id, session

    def _live(self, session: Session, now: float) -> bool:
        return (
            not session.ended.is_set()
            and now < session.expires
            and (now - session.last_seen < self.idle)
        )

    def get(self, session_id: str) -> Session | None:
        """The live session with this id, marked used now; None for an unknown id (another
        console's, a forged one) or an ended one (which is dropped)."""
        if not session_id:
            return None
        digest = _digest(session_id)
        session = self._by_digest.get(digest)
        if session is None:
            return None
        now = self.clock()
        if not self._live(session, now):
            del self._by_digest[digest]
            session.end()
            return None
        session.last_seen = now
        self._by_digest.move_to_end(digest)
        return session

    def due(self, session: Session) -> bool:
        """Whether the session's token is to be checked through flaps again."""
        return self.clock() - session.checked >= self.recheck

    def end(self, session_id: str) -> bool:
        """Log the session out; whether there was one."""
        session = self._by_digest.pop(_digest(session_id), None)
        if session is None:
            return False
        session.end()
        return True

    def drop(self, session: Session) -> None:
        """End this session (its token is no longer good)."""
        for digest, held in list(self._by_digest.items()):
            if held is session:
                del self._by_digest[digest]
        session.end()

    def sweep(self) -> int:
        """End every session that has expired or idled out (their streams with them); how many."""
        now = self.clock()
        gone = [d for d, s in self._by_digest.items() if not self._live(s, now)]
        for digest in gone:
            self._by_digest.pop(digest).end()
        return len(gone)

    async def sweep_every(self, seconds: float, shutdown: asyncio.Event) -> None:
        """`sweep` every `seconds` until shutdown: an expired session's open streams end on
        time, not when it next asks for something."""
        while not shutdown.is_set():
            self.sweep()
            try:
                await asyncio.wait_for(shutdown.wait(), seconds)
            except TimeoutError:
                continue

    def close(self) -> None:
        """End every session (the console is stopping)."""
        for session in self._by_digest.values():
            session.end()
        self._by_digest.clear()


@dataclass(frozen=True)
class _Code:
    token: str = field(repr=False)
    scope: Scope
    expires: float


class LoginCodes:
    """One-time login codes (see the module docstring): at most `max_codes` outstanding, the
    oldest dropped first."""

    def __init__(
        self, clock: Callable[[], float], *, ttl: float = CODE_TTL, max_codes: int = MAX_CODES
    ) -> None:
        if ttl <= 0 or max_codes < 1:
            raise ValueError("LoginCodes: ttl must be > 0 and max_codes >= 1")
        self.clock = clock
        self.ttl = ttl
        self.max_codes = max_codes
        self._codes: collections.OrderedDict[bytes, _Code] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._codes)

    def issue(self, token: str, scope: Scope) -> str:
        """A new code standing for `token` (already verified, with `scope`)."""
        now = self.clock()
        for digest in [d for d, c in self._codes.items() if c.expires <= now]:
            del self._codes[digest]
        code = secrets.token_urlsafe(24)
        expires = now + self.ttl
        if scope.expires:
            expires = min(expires, float(scope.expires))
        self._codes[_digest(code)] = _Code(token, scope, expires)
        while len(self._codes) > self.max_codes:
            self._codes.popitem(last=False)
        return code

    def redeem(self, code: str) -> tuple[str, Scope] | None:
        """The token and scope a code stands for, once: a used, expired or unknown code is
        None (and a used one stays used)."""
        held = self._codes.pop(_digest(code), None) if code else None
        if held is None or self.clock() >= held.expires:
            return None
        return held.token, held.scope
