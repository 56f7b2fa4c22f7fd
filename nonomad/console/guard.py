"""The console's front door: every request passes here before any route does.

In order, each refusal with its reason (as JSON or as a page, `render.error_response`):

1. **Host.** A request whose `Host` is not one the console serves on is a 421, whatever its
   path: its bind address and loopback names with its port, and the names the operator
   configures (`hosts`). That is what stops DNS rebinding: a page of `evil.example` whose name
   now resolves to 127.0.0.1 still sends `Host: evil.example`.
2. **Cross-site.** A request that is not a GET or HEAD (login, logout) is refused, 403, when
   the browser says it comes from another site: `Sec-Fetch-Site` other than `same-origin`, an
   `Origin` or `Referer` of another origin. One without `Authorization` (a form) must also
   show it comes from here: `Sec-Fetch-Site: same-origin` (with `Origin: null`, what a browser
   sends from a page whose `Referrer-Policy` is `no-referrer`, as this console's are), or an
   `Origin` or `Referer` of this console's. A program (`nonomad up`) sends `Authorization:
   Bearer`, which no other site can make a browser send. The forms carry a CSRF token too
   (`login`): the check here and the token are two locks, not a choice between them.
3. **Session.** Every path but the login's and the static files (`PUBLIC`) needs a live
   session: without one, a page is a 303 to the login (nothing of the page is sent), anything
   else (JSON, a stream) a 401. A session whose token is due is checked through flaps again
   first: refused there, the session ends (401).

Every answer, refusals included, carries `HEADERS`: no caching, no sniffing, no referrer, no
framing, and a content security policy that allows this origin's script and style files and
nothing inline.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nonomad.client import Client
from nonomad.console import access, render
from nonomad.console.sessions import LoginCodes, Session, Sessions

__all__ = ["HEADERS", "PUBLIC", "Door", "Guard", "Served", "session_of"]

log = structlog.get_logger("console.guard")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS: tuple[tuple[str, str], ...] = (
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("content-security-policy", CSP),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
)
HSTS = ("strict-transport-security", "max-age=31536000")
PUBLIC = ("/login", "/login/codes")
PUBLIC_PREFIX = "/static/"
_SAFE = ("GET", "HEAD")
_LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
_WILDCARD = ("", "0.0.0.0", "::", "[::]")


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _has_port(name: str) -> bool:
    return name.rpartition("]")[2].count(":") == 1 if name.startswith("[") else ":" in name


@dataclass(frozen=True)
class Served:
    """Where the console serves: the `Host` values it answers (lowercase), its scheme, and
    its cookies' names (by port: consoles on one host share cookies across ports)."""

    port: int
    tls: bool
    hosts: frozenset[str]

    @classmethod
    def of(cls, bind: str, port: int, *, tls: bool = False, names: Sequence[str] = ()) -> Served:
        """The loopback names and `bind` (unless a wildcard) with `port`, and each of `names`
        as written (with its port, or bare and with `port`)."""
        default = 443 if tls else 80
        hosts: set[str] = set()
        own = [h for h in (*_LOOPBACK, _bracketed(bind)) if h not in _WILDCARD]
        for host in own:
            hosts.add(f"{host.lower()}:{port}")
            if port == default:
                hosts.add(host.lower())
        for name in names:
            name = name.strip().lower()
            hosts.add(name)
            if not _has_port(name):
                hosts.add(f"{name}:{port}")
        return cls(port, tls, frozenset(hosts))

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def allows(self, host: str) -> bool:
        return host.strip().lower() in self.hosts

    def origin(self, host: str) -> str:
        """This console's origin as a browser at `host` (one it allows) writes it."""
        return f"{self.scheme}://{host.strip().lower()}"

    @property
    def cookie(self) -> str:
        """The session cookie (`__Host-`: a browser then takes it only over TLS, for `/`, from
        this host alone)."""
        return f"__Host-nonomad-console-{self.port}" if self.tls else f"nonomad-console-{self.port}"

    @property
    def login_cookie(self) -> str:
        """The login form's CSRF cookie."""
        return f"__Host-nonomad-login-{self.port}" if self.tls else f"nonomad-login-{self.port}"


@dataclass(frozen=True)
class Door:
    """What the front door and the login share: where the console serves, its sessions and
    login codes, how a token is checked (`access.TokenCheck`, or a test's own) and flaps."""

    served: Served
    sessions: Sessions
    codes: LoginCodes
    check: Callable[[str], Awaitable[access.Scope]]
    flaps: Client
    """flaps, as the console calls it; each session calls it with its own token."""


def session_of(request: Request) -> Session:
    """The request's session (the guard set it: every route outside PUBLIC has one)."""
    session: Session = request.state.session
    return session


def _origin_of(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _cross_site(request: Request, own: str) -> str:
    """Why a state-changing request is not from this console's own pages; "" when it is (or
    is a program's, with `Authorization`)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        return f"a {site} request may not {request.method} here"
    origin = request.headers.get("origin")
    if origin is not None and origin != "null" and origin.lower() != own:
        return f"Origin {origin} is not this console's ({own})"
    referer = request.headers.get("referer")
    if referer and _origin_of(referer) != own:
        return f"Referer is not this console's ({own})"
    if "authorization" in request.headers or site == "same-origin":
        return ""
    if (origin is not None and origin.lower() == own) or (referer and _origin_of(referer) == own):
        return ""
    return f"a {request.method} needs the Origin of this console's pages ({own})"


class Guard:
    """The ASGI middleware of the module docstring, around the console's routes."""

    def __init__(self, app: ASGIApp, door: Door) -> None:
        self.app = app
        self.door = door
        self.headers = [(k.encode(), v.encode()) for k, v in HEADERS]
        if door.served.tls:
            self.headers.append((HSTS[0].encode(), HSTS[1].encode()))
        self._ours = {k for k, _ in self.headers}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # no websockets here; lifespan is off
            return
        headers = self.headers
        ours = self._ours

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in ours]
                message = {**message, "headers": kept + headers}
            await send(message)

        request = Request(scope, receive)
        refusal = await self._refusal(request)
        if refusal is not None:
            await refusal(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)

    async def _refusal(self, request: Request) -> Response | None:
        """The answer that stops the request here, or None to go on (with its session set)."""
        served, sessions = self.door.served, self.door.sessions
        host = request.headers.get("host", "")
        if not served.allows(host):
            log.info("console_wrong_host", host=host[:200], path=request.url.path)
            return render.error_response(
                request, 421, f"this console does not serve host {host[:200]!r}"
            )
        if request.method not in _SAFE:
            why = _cross_site(request, served.origin(host))
            if why:
                log.info("console_cross_site", path=request.url.path, reason=why)
                return render.error_response(request, 403, why)
        path = request.url.path
        if path in PUBLIC or path.startswith(PUBLIC_PREFIX):
            return None
        session = sessions.get(request.cookies.get(served.cookie, ""))
        if session is None:
            return self._login_first(request)
        if sessions.due(session):
            refused = await self._recheck(session)
            if refused is not None:
                return render.error_response(request, refused.status, refused.reason)
        request.state.session = session
        return None

    def _login_first(self, request: Request) -> Response:
        if request.method in _SAFE and not (
            render.wants_json(request) or request.url.path.startswith("/live/")
        ):
            here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(
                "/login?" + urllib.parse.urlencode({"next": here}), status_code=303
            )
        return render.error_response(request, 401, "log in first: no session, or it ended")

    async def _recheck(self, session: Session) -> access.LoginRefused | None:
        """Check the session's token through flaps again (once for concurrent requests); a
        refusal ends the session, a flaps that does not answer only fails this request."""
        async with session.checking:
            if not self.door.sessions.due(session):
                return None if not session.ended.is_set() else _ended()
            try:
                await self.door.check(session.token)
            except access.LoginRefused as err:
                if err.status == 503:
                    return err
                log.info("console_session_ended", token_id=session.scope.token_id, why=err.reason)
                self.door.sessions.drop(session)
                return access.LoginRefused(401, f"session ended: {err.reason}")
            session.checked = self.door.sessions.clock()
        return None


def _ended() -> access.LoginRefused:
    return access.LoginRefused(401, "session ended: its token was refused")
