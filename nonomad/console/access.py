"""Who is looking, and what they may see: the operator's token, checked, and its scope.

A session starts from a token (pasted into the login form, or behind a one-time login code
that `nonomad up` asks for). `verify_token` is the one place a token is judged: until flaps has
a call that says what a token is (another part of issue 27 makes one for the proxy; swap it in
here), it asks flaps to list one machine with the token: flaps checks the signature against its
root keys, the expiry, and that the token may read, and answers UNAUTHENTICATED or
PERMISSION_DENIED otherwise. The console holds no root key, so it cannot check a signature
itself; the caveats it then reads from the token are the ones flaps just verified (a changed
caveat breaks the signature).

`Scope` is what the session may see, from those caveats, checked as flaps checks a call
(`model.tokens.Grant`): an app only if the token may read it, a machine only if it may read
that machine, and the fleet (workers, regions, their feed items) only with a token that is not
limited to some apps and may do the fleet's reads (`workers`, `regions`). Every page, stream
and feed item goes through it; the calls the console makes to flaps for a session carry the
session's own token, so flaps checks them again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from model.tokens import Caveat, Denied, Grant, InvalidToken, inspect
from nonomad.client import (
    ApiError,
    Client,
    DeadlineExceeded,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)

__all__ = ["EVERYTHING", "NOTHING", "LoginRefused", "Scope", "TokenCheck", "verify_token"]

FLEET_OPS = ("workers", "regions")
VERIFY_TIMEOUT = 5.0


class LoginRefused(Exception):
    """A token (or a login code) that does not open a session: `status` is the HTTP answer
    (401 not valid, 403 valid but may not read, 503 flaps did not answer), the message why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Scope:
    """What one session may see (see the module docstring). `grant` None: nothing."""

    grant: Grant | None

    @property
    def token_id(self) -> str:
        return self.grant.token_id if self.grant is not None else ""

    @property
    def expires(self) -> int:
        """The token's own expiry (Unix seconds, the earliest `expires` caveat); 0: none."""
        if self.grant is None:
            return 0
        times = [c.expires for c in self.grant.caveats if c.key == "expires"]
        return min(times) if times else 0

    def _allows(self, ops: tuple[str, ...], app: str | None, machine: str | None) -> str:
        """Why the token does not allow `ops` there; empty when it does."""
        if self.grant is None:
            return "no session"
        try:
            self.grant.check(ops, app, machine)
        except Denied as err:
            return str(err)
        return ""

    @property
    def fleet(self) -> bool:
        """Whether the session sees the fleet: workers, regions and their feed items."""
        if self.grant is None or self.grant.limits_apps:
            return False
        if any(c.key == "machines" for c in self.grant.caveats):
            return False
        return not self._allows(FLEET_OPS, None, None)

    @property
    def limits_machines(self) -> bool:
        """Whether some machines of an app it sees may be hidden from it (a `machines`
        caveat): then counts are made over the machines it sees."""
        return self.grant is None or any(c.key == "machines" for c in self.grant.caveats)

    def why_not_app(self, app: str) -> str:
        """The caveat that does not let the session see `app`; empty when it may."""
        return self._allows(("read",), app, None)

    def app(self, app: str) -> bool:
        return not self.why_not_app(app)

    def machine(self, app: str, machine_id: str) -> bool:
        return not self._allows(("read",), app, machine_id)

    def item(self, item: Mapping[str, object]) -> bool:
        """Whether the session sees a feed item: a worker's needs the fleet, an app's needs
        the app (and the machine it names, if any)."""
        app, machine_id = str(item.get("app", "")), str(item.get("machine_id", ""))
        if not app:
            return self.fleet
        if machine_id:
            return self.machine(app, machine_id)
        return self.app(app)

    @property
    def apps(self) -> list[str]:
        """The apps every `apps` caveat allows, sorted; ["*"]: any."""
        if self.grant is None:
            return []
        apps: list[str] = ["*"]
        for c in self.grant.caveats:
            if c.key == "apps" and "*" not in c.values:
                apps = sorted(c.values if apps == ["*"] else set(apps) & c.values)
        return apps

    def describe(self) -> dict[str, object]:
        """For the pages: whose session, over which apps, and whether it sees the fleet."""
        return {"token_id": self.token_id, "apps": self.apps, "fleet": self.fleet}


NOTHING = Scope(None)
"""The scope of no session: it sees nothing."""
EVERYTHING = Scope(Grant("everything", ()))
"""A scope without caveats (tests, and a token with none)."""


def _grant_of(token: str) -> Grant:
    """The token's caveats as a grant, read without verifying the signature (flaps does)."""
    try:
        info = inspect(token)
        return Grant(info.token_id, tuple(Caveat.parse(text) for text in info.caveats))
    except (InvalidToken, ValueError) as err:  # not a token, or a caveat unknown here
        raise LoginRefused(401, f"token: {err}") from None


async def verify_token(flaps: Client, token: str, now: float) -> Scope:
    """The scope of a valid token that may read; LoginRefused otherwise. See the module
    docstring: flaps judges the token, by a one-machine ListMachines made with it."""
    token = token.strip()
    if not token:
        raise LoginRefused(401, "token: empty")
    grant = _grant_of(token)
    scope = Scope(grant)
    if scope.expires and now >= scope.expires:
        raise LoginRefused(401, f"token {grant.token_id} has expired")
    # An app-limited token asks about one of its apps (one every `apps` caveat allows: flaps
    # checks read on it); any other, about every app (flaps checks read, and lists only what
    # it may read).
    apps = scope.apps
    if not apps:
        raise LoginRefused(403, f"token {grant.token_id}: its apps caveats allow no app at all")
    app = "" if apps == ["*"] else apps[0]
    try:
        await flaps.with_token(token).list_machines(app, limit=1, timeout=VERIFY_TIMEOUT)
    except Unauthenticated as err:
        raise LoginRefused(401, f"flaps refused the token: {err.message}") from None
    except PermissionDenied as err:
        raise LoginRefused(403, f"the token may not read: {err.message}") from None
    except (Unavailable, DeadlineExceeded) as err:
        raise LoginRefused(503, f"flaps did not answer: {err.message}") from None
    except ApiError as err:
        raise LoginRefused(503, f"flaps: {err.code.name}: {err.message}") from None
    return scope


class TokenCheck:
    """`verify_token` against one flaps, at most `at_once` checks in flight: a burst of
    logins (or of bad tokens) is refused at once, 503, rather than queued."""

    def __init__(self, flaps: Client, clock: Callable[[], float], *, at_once: int = 8) -> None:
        self.flaps = flaps
        self.clock = clock
        self.at_once = at_once
        self._running = 0

    async def __call__(self, token: str) -> Scope:
        if self._running >= self.at_once:
            raise LoginRefused(503, f"{self.at_once} logins are being checked: try again")
        self._running += 1
        try:
            return await verify_token(self.flaps, token, self.clock())
        finally:
            self._running -= 1
