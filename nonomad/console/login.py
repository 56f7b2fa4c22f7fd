"""Logging in to the console and out of it, and the one-time login URL `nonomad up` prints.

- `GET /login`: the form (paste a token). With `?code=` opened from outside the browser
  (`Sec-Fetch-Site: none`: a click in the terminal, a pasted URL), the code is exchanged at
  once; opened from anywhere else (a link on some page), the form asks to confirm, so no other
  site can log a browser in, even to a session of its own.
- `POST /login`: a form with its CSRF token (`csrf`, matching the form's cookie) and a `token`
  or a `code`; or a program's `Authorization: Bearer <token>`. Either opens a session: its
  cookie (HttpOnly, SameSite=Strict, Path=/, Secure over TLS) and a 303 to `next` (a JSON
  client gets its scope instead).
- `POST /login/codes`, with `Authorization: Bearer <token>`: a one-time code for that token
  (`sessions.LoginCodes`), the URL to open, and how long it works.
- `POST /logout`, with the session's CSRF token: the session ends, its streams with it.

A token is checked through flaps (`access.verify_token`) before anything is opened; neither
it nor a code is ever logged (the token's id is).
"""

from __future__ import annotations

import hmac
import json
import secrets
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from nonomad.console import render
from nonomad.console.access import LoginRefused, Scope
from nonomad.console.guard import Door, session_of
from nonomad.console.sessions import Session

__all__ = ["Login", "login_url"]

log = structlog.get_logger("console.login")

MAX_FORM = 16 * 1024
"""The most a login or logout form may be (a token is a few hundred bytes)."""
FORM_FIELDS = 8
LOGIN_FORM_TTL = 3600


def _next(raw: str | None) -> str:
    """Where to go after the login: a path of this console, else its front page."""
    if not raw or not raw.startswith("/") or raw.startswith(("//", "/\\")):
        return "/"
    if any(c in raw for c in "\r\n\\") or urllib.parse.urlsplit(raw).netloc:
        return "/"
    return raw


async def _form(request: Request) -> dict[str, str]:
    """The urlencoded form of the request, at most MAX_FORM bytes; 400/413/415 otherwise."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise HTTPException(415, "expected a form (application/x-www-form-urlencoded)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            raise HTTPException(413, f"the form is over {MAX_FORM} bytes")
    try:
        fields = urllib.parse.parse_qs(
            bytes(body).decode(), keep_blank_values=True, max_num_fields=FORM_FIELDS
        )
    except (UnicodeDecodeError, ValueError):
        raise HTTPException(400, "the form is not valid urlencoded UTF-8") from None
    return {key: values[0] for key, values in fields.items()}


def _bearer(request: Request) -> str | None:
    raw = request.headers.get("authorization")
    if raw is None:
        return None
    scheme, _, token = raw.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(401, "authorization: expected `Bearer <token>`")
    return token.strip()


class Login:
    """The routes of the module docstring, over the door's sessions, codes and check."""

    def __init__(self, door: Door) -> None:
        self.door = door
        self.served = door.served

    # -- the form ------------------------------------------------------------------------------

    def _form_page(
        self, request: Request, *, status: int = 200, error: str = "", code: str = ""
    ) -> Response:
        csrf = secrets.token_urlsafe(24)
        html = render.page(
            "login.html",
            csrf=csrf,
            code=code,
            next=_next(request.query_params.get("next")),
            error=error,
        )
        response = HTMLResponse(html, status_code=status)
        self._cookie(response, self.served.login_cookie, csrf, LOGIN_FORM_TTL)
        return response

    def _cookie(self, response: Response, name: str, value: str, max_age: int) -> None:
        """Set (or, with `max_age` 0, drop) a cookie with every attribute of the console's: a
        browser takes a `__Host-` one only with them, its removal too."""
        response.set_cookie(
            name,
            value,
            max_age=max_age,
            path="/",
            secure=self.served.tls,
            httponly=True,
            samesite="strict",
        )

    async def form(self, request: Request) -> Response:
        code = request.query_params.get("code", "")
        if code and request.headers.get("sec-fetch-site") == "none":
            try:
                token, scope = self._redeem(code)
            except LoginRefused as err:
                return self._form_page(request, status=err.status, error=err.reason)
            return self._opened(request, token, scope, via="code", then=request.query_params)
        return self._form_page(request, code=code)

    # -- logging in ----------------------------------------------------------------------------

    def _redeem(self, code: str) -> tuple[str, Scope]:
        held = self.door.codes.redeem(code)
        if held is None:
            raise LoginRefused(
                401, "login code: unknown, used or expired (a code works once, for minutes)"
            )
        return held

    async def submit(self, request: Request) -> Response:
        bearer = _bearer(request)
        try:
            if bearer is not None:
                scope = await self.door.check(bearer)
                return self._opened(request, bearer, scope, via="authorization", then={})
            fields = await _form(request)
            cookie = request.cookies.get(self.served.login_cookie, "")
            if not cookie or not hmac.compare_digest(cookie, fields.get("csrf", "")):
                raise HTTPException(403, "the login form's CSRF token does not match: reload it")
            if fields.get("code"):
                token, scope = self._redeem(fields["code"])
                return self._opened(request, token, scope, via="code", then=fields)
            token = fields.get("token", "").strip()
            scope = await self.door.check(token)
            return self._opened(request, token, scope, via="form", then=fields)
        except LoginRefused as err:
            log.info("console_login_refused", status=err.status, reason=err.reason)
            if render.wants_json(request) or bearer is not None:
                return render.error_response(request, err.status, err.reason)
            return self._form_page(request, status=err.status, error=err.reason)

    def _opened(
        self, request: Request, token: str, scope: Scope, *, via: str, then: Mapping[str, str]
    ) -> Response:
        """A session for the token: its cookie, and the way on (`then["next"]`)."""
        sessions = self.door.sessions
        session_id, session = sessions.open(token, scope, self.door.flaps.with_token(token))
        log.info("console_login", via=via, **scope.describe())
        response: Response
        if render.wants_json(request) or via == "authorization":
            response = JSONResponse(_scope_json(session))
        else:
            response = RedirectResponse(_next(then.get("next")), status_code=303)
        lifetime = max(1, int(session.expires - sessions.clock()))
        self._cookie(response, self.served.cookie, session_id, lifetime)
        self._cookie(response, self.served.login_cookie, "", 0)  # the form's, used
        return response

    async def issue_code(self, request: Request) -> Response:
        token = _bearer(request)
        if token is None:
            raise HTTPException(401, "authorization: `Bearer <token>` asks for a login code")
        try:
            scope = await self.door.check(token)
        except LoginRefused as err:
            return render.error_response(request, err.status, err.reason)
        code = self.door.codes.issue(token, scope)
        log.info("console_login_code", token_id=scope.token_id)
        return JSONResponse(
            {
                "url": "/login?" + urllib.parse.urlencode({"code": code}),
                "expires_in": int(self.door.codes.ttl),
                "token_id": scope.token_id,
            }
        )

    # -- logging out ---------------------------------------------------------------------------

    async def logout(self, request: Request) -> Response:
        session = session_of(request)
        fields = await _form(request)
        if not hmac.compare_digest(session.csrf, fields.get("csrf", "")):
            raise HTTPException(403, "the logout form's CSRF token does not match: reload it")
        self.door.sessions.end(request.cookies.get(self.served.cookie, ""))
        log.info("console_logout", token_id=session.scope.token_id)
        response: Response
        if render.wants_json(request):
            response = JSONResponse({"logged_out": True})
        else:
            response = RedirectResponse("/login", status_code=303)
        self._cookie(response, self.served.cookie, "", 0)
        return response


def _scope_json(session: Session) -> dict[str, object]:
    return {**session.scope.describe(), "expires_in": round(session.expires - session.created)}


def login_url(console: str, token: str, *, timeout: float = 10.0) -> str:
    """A one-time login URL for `token` from the console at `console` (an http:// or
    https:// base URL): the console checks the token, and the URL holds a code, never the
    token. ValueError saying why when the console refuses or does not answer."""
    base = console.rstrip("/")
    ask = urllib.request.Request(
        f"{base}/login/codes",
        method="POST",
        data=b"",
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(ask, timeout=timeout) as reply:
            answer = json.load(reply)
    except urllib.error.HTTPError as err:
        with err:
            try:
                reason = json.load(err).get("reason", "")
            except ValueError:
                reason = ""
        raise ValueError(f"the console refused a login code: {err.code} {reason}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"the console did not answer for a login code: {err}") from None
    return f"{base}{answer['url']}"
