"""The console's front door, in process (tests.console.support): who gets in, with what, and
what they see once in.

Attack 6 of issue 27 was any web page (DNS rebinding) or local user reading every app's
machines, env and live logs with `Host: evil.example` and no credentials. Here each way in is
tried: another Host, no cookie, a cross-site request, a forged, expired or used login code,
an expired session, another console's cookie, a bad or revoked token. Each is refused with its
status and reason, and serves nothing of the cluster. Then the ways that work: a login form,
a one-time code, a program's bearer login, and a token limited to one app that sees that app
only.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import httpx
import pytest
from pymacaroons import Macaroon
from structlog.testing import capture_logs

from model.tokens import Grant, Keyring, attenuate, caveats
from nonomad.console.access import Scope
from nonomad.console.app import build
from nonomad.console.guard import CSP, Door, Served
from nonomad.console.sessions import CODE_TTL, RECHECK, SESSION_IDLE, SESSION_TTL, Sessions
from nonomad.console.streams import LINE_MAX
from runtime.clock import ManualClock
from tests.console.support import HOST, ORIGIN, Console, S, T, machine, stream

# What any page of the console would show of the fake cluster: none of it may be in a refusal.
# (Each too long, or too quoted, to turn up in a random CSRF token of the login form.)
SHOWN = ("w0-web", "w1-web", "w2-web", "web:v1", '"w1"', '"w2"', "worker-w")
PAGES = ("/", "/apps", "/apps/web", "/machines/w0-web", "/events")
STREAMS = ("/live/fleet", "/live/apps/web", "/live/machines/w0-web", "/live/events")
LOGS = "/live/machines/w0-web/logs"
EVIL = "https://evil.example"
CREATED, STARTED, STOPPED = (
    S.MACHINE_STATE_CREATED,
    S.MACHINE_STATE_STARTED,
    S.MACHINE_STATE_STOPPED,
)


def shows_nothing(reply: httpx.Response) -> None:
    for text in SHOWN:
        assert text not in reply.text, f"{text!r} served in a refusal: {reply.text[:300]}"


async def csrf_of(http: httpx.AsyncClient, path: str = "/login") -> str:
    """The CSRF token of the form on `path` (it also sets the login form's cookie)."""
    page = await http.get(path, timeout=T)
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found, page.text
    return found.group(1)


async def form_login(
    c: Console,
    http: httpx.AsyncClient,
    *,
    token: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    next_: str = "/",
) -> httpx.Response:
    """Log in through the form as a browser on the console's own page does."""
    fields = {"csrf": await csrf_of(http), "next": next_}
    if code is not None:
        fields["code"] = code
    else:
        fields["token"] = token or c.admin
    return await http.post(
        "/login", data=fields, headers={"Origin": ORIGIN} if headers is None else headers
    )


async def new_code(c: Console, token: str | None = None) -> str:
    reply = await c.client().post(
        "/login/codes", headers={"Authorization": f"Bearer {token or c.admin}"}, timeout=T
    )
    assert reply.status_code == 200, reply.text
    url = reply.json()["url"]
    assert url.startswith("/login?code=")
    return str(url.removeprefix("/login?code="))


def cookie_header(reply: httpx.Response, name: str) -> str:
    (header,) = [h for h in reply.headers.get_list("set-cookie") if h.startswith(f"{name}=")]
    return header


# -- the attack: every way in without a login ----------------------------------------------------


@pytest.mark.parametrize("path", [*PAGES, *STREAMS, LOGS, "/login", "/static/console.js"])
async def test_another_host_is_refused_even_with_a_session(console: Console, path: str) -> None:
    """DNS rebinding: a page of evil.example whose name now points at the console sends its
    own name as Host. (Its requests have no cookie of the console's; this one does, and is
    refused all the same.)"""
    calls = console.flaps.token_calls
    reply = await console.http.get(
        path, headers={"Host": "evil.example", "Accept": "application/json"}, timeout=T
    )
    assert reply.status_code == 421
    assert reply.json() == {
        "status": 421,
        "reason": "this console does not serve host 'evil.example'",
    }
    shows_nothing(reply)
    assert console.flaps.token_calls == calls  # nothing was asked of flaps
    assert console.flaps.following_logs == 0


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "console.test:81",
        "127.0.0.1:8090",
        "localhost:8090",
        "127.0.0.1.evil.example",
        "",
    ],
)
async def test_only_the_hosts_it_serves_on_pass(console: Console, host: str) -> None:
    reply = await console.http.get("/", headers={"Host": host}, timeout=T)
    assert reply.status_code == 421
    shows_nothing(reply)


def test_the_hosts_a_console_serves_on() -> None:
    served = Served.of("127.0.0.1", 8090, names=["console.example.com", "edge.example:443"])
    assert served.hosts == {
        "127.0.0.1:8090",
        "localhost:8090",
        "[::1]:8090",
        "console.example.com",
        "console.example.com:8090",
        "edge.example:443",
    }
    assert served.allows("LOCALHOST:8090")
    assert not served.allows("localhost")
    assert not served.allows("edge.example")
    # A wildcard bind answers the loopback names and what the operator names, nothing else.
    assert Served.of("0.0.0.0", 80).hosts == {
        "127.0.0.1:80",
        "localhost:80",
        "[::1]:80",
        "127.0.0.1",
        "localhost",
        "[::1]",
    }
    assert "[::1]:9000" in Served.of("::1", 9000).hosts


@pytest.mark.parametrize("path", [*PAGES, *STREAMS, LOGS])
@pytest.mark.parametrize("accept", ["text/html", "application/json", "text/event-stream"])
async def test_without_a_session_nothing_is_served(
    console: Console, path: str, accept: str
) -> None:
    calls = console.flaps.token_calls
    reply = await console.client().get(path, headers={"Accept": accept}, timeout=T)
    page = accept != "application/json" and not path.startswith("/live/")
    if page:  # a browser is sent to the login, and comes back after it
        assert reply.status_code == 303
        assert reply.headers["location"] == "/login?" + str(httpx.QueryParams(next=path))
        assert reply.content == b""
    else:
        assert reply.status_code == 401
        assert reply.json()["reason"] == "log in first: no session, or it ended"
    shows_nothing(reply)
    assert console.flaps.token_calls == calls
    assert console.flaps.following_logs == 0


async def test_the_login_page_and_static_files_need_no_session(console: Console) -> None:
    http = console.client()
    assert (await http.get("/static/console.js")).status_code == 200
    login = await http.get("/login")
    assert login.status_code == 200
    assert 'name="token"' in login.text
    shows_nothing(login)


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"Origin": EVIL}, f"Origin {EVIL} is not this console's ({ORIGIN})"),
        ({"Origin": f"{ORIGIN}:8080"}, f"Origin {ORIGIN}:8080 is not this console's"),
        ({"Origin": ORIGIN, "Sec-Fetch-Site": "cross-site"}, "a cross-site request may not"),
        ({"Origin": ORIGIN, "Sec-Fetch-Site": "same-site"}, "a same-site request may not POST"),
        ({"Origin": "null"}, f"a POST needs the Origin of this console's pages ({ORIGIN})"),
        ({"Referer": "https://evil.example/x"}, "Referer is not this console's"),
        ({}, f"a POST needs the Origin of this console's pages ({ORIGIN})"),
    ],
)  # fmt: skip
async def test_a_login_from_another_site_is_refused(
    console: Console, headers: dict[str, str], reason: str
) -> None:
    http = console.client()
    reply = await form_login(console, http, headers={**headers, "Accept": "application/json"})
    assert reply.status_code == 403
    assert reply.json()["reason"].startswith(reason)
    assert console.http.cookies.get(console.door.served.cookie) is not None
    assert http.cookies.get(console.door.served.cookie) is None
    assert len(console.sessions) == 1  # the fixture's own, no other


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": ORIGIN},
        {"Origin": "null", "Sec-Fetch-Site": "same-origin"},  # no-referrer's own pages
        {"Sec-Fetch-Site": "same-origin"},
        {"Referer": f"{ORIGIN}/login"},
    ],
)
async def test_a_login_from_the_consoles_own_page_passes(
    console: Console, headers: dict[str, str]
) -> None:
    reply = await form_login(console, console.client(), headers=headers)
    assert reply.status_code == 303
    assert reply.headers["location"] == "/"


async def test_a_login_form_without_its_csrf_token_is_refused(console: Console) -> None:
    http = console.client()
    await csrf_of(http)
    for fields in ({"token": console.admin}, {"token": console.admin, "csrf": "guessed"}):
        reply = await http.post("/login", data=fields, headers={"Origin": ORIGIN})
        assert reply.status_code == 403
        assert "CSRF token does not match" in reply.text
    # Without the form's cookie (another browser's form), the field alone does not do.
    other = console.client()
    csrf = await csrf_of(other)
    reply = await http.post(
        "/login", data={"token": console.admin, "csrf": csrf}, headers={"Origin": ORIGIN}
    )
    assert reply.status_code == 403
    assert len(console.sessions) == 1


async def test_a_forged_used_or_expired_login_code_opens_nothing(console: Console) -> None:
    refused = "login code: unknown, used or expired (a code works once, for minutes)"
    typed = {"Sec-Fetch-Site": "none"}

    async def redeem(code: str) -> httpx.Response:
        return await console.client().get(f"/login?code={code}", headers=typed)

    forged = await redeem("A" * 32)
    assert (forged.status_code, refused) == (401, refused)
    assert refused in forged.text
    code = await new_code(console)
    assert (await redeem(code)).status_code == 303
    used = await redeem(code)
    assert used.status_code == 401
    assert refused in used.text
    late = await new_code(console)
    console.clock.advance(CODE_TTL)
    expired = await redeem(late)
    assert expired.status_code == 401
    assert refused in expired.text
    for reply in (forged, used, expired):
        assert console.door.served.cookie not in reply.headers.get("set-cookie", "")
        shows_nothing(reply)
    assert len(console.sessions) == 2  # the fixture's, and the one good redemption


async def test_a_login_link_followed_from_another_site_asks_first(console: Console) -> None:
    """A link to /login?code=... on some page (an attacker's own code: login CSRF) does not
    log the browser in by itself: the page asks, and the code still works after."""
    code = await new_code(console)
    http = console.client()
    linked = await http.get(f"/login?code={code}", headers={"Sec-Fetch-Site": "cross-site"})
    assert linked.status_code == 200
    assert f'name="code" value="{code}"' in linked.text
    assert http.cookies.get(console.door.served.cookie) is None
    reply = await form_login(console, http, code=code)
    assert reply.status_code == 303
    assert (await http.get("/", headers={"Accept": "application/json"})).status_code == 200


@pytest.mark.parametrize(
    ("how", "status", "reason"),
    [
        ("garbage", 401, "token: not a nonomad token"),
        ("another cluster's", 401, "flaps refused the token: authorization: token "),
        ("expired", 401, "has expired"),
        ("tampered", 401, "flaps refused the token: authorization: token "),
        ("may not read", 403, "the token may not read: token caveat \"ops = create\""),
        ("unknown caveat", 401, "token: caveat \"colour = blue\": unknown key 'colour'"),
    ],
)  # fmt: skip
async def test_a_token_flaps_would_refuse_opens_no_session(
    console: Console, how: str, status: int, reason: str
) -> None:
    keyring = console.keyring
    token = {
        "garbage": "not-a-token",
        "another cluster's": Keyring([("k1", b"o" * 32)]).mint(caveats(apps=["*"], ops=["*"])),
        "expired": keyring.mint(caveats(expires=console.clock.now() - 1)),
        "tampered": _widened(keyring.mint(caveats(apps=["web"]))),
        "may not read": keyring.mint(caveats(ops=["create"])),
        "unknown caveat": _with_caveat(keyring.mint([]), "colour = blue"),
    }[how]
    bearer = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    for path in ("/login", "/login/codes"):
        reply = await console.client().post(path, headers=bearer)
        assert reply.status_code == status, reply.text
        assert reason in reply.json()["reason"]
        assert "set-cookie" not in reply.headers
    http = console.client()
    reply = await form_login(console, http, token=token)
    assert reply.status_code == status
    assert http.cookies.get(console.door.served.cookie) is None
    assert len(console.sessions) == 1
    assert len(console.codes) == 0


def _widened(token: str) -> str:
    """The token with its `apps = web` caveat replaced by one for every app, its signature
    kept (so it no longer matches)."""
    m = Macaroon.deserialize(token)
    forged = Macaroon(location=m.location, identifier=m.identifier, key=b"x" * 32)
    forged.add_first_party_caveat("apps = *")
    forged.signature = m.signature
    return str(forged.serialize())


def _with_caveat(token: str, caveat: str) -> str:
    """The token with a caveat the console does not know (attenuated: still validly signed)."""
    m = Macaroon.deserialize(token)
    m.add_first_party_caveat(caveat)
    return str(m.serialize())


async def test_an_expired_or_idle_session_is_refused(console: Console) -> None:
    assert (await console.get("/", as_json=True)).status_code == 200
    console.clock.advance(SESSION_IDLE)
    idle = await console.get("/", as_json=True)
    assert idle.status_code == 401
    assert len(console.sessions) == 0  # dropped, not kept
    # One used all along still ends after its TTL.
    await console.login()
    for _ in range(int(SESSION_TTL // (SESSION_IDLE / 2))):
        console.clock.advance(SESSION_IDLE / 2)
        reply = await console.get("/", as_json=True)
    assert reply.status_code == 401
    shows_nothing(reply)


async def test_a_session_never_outlives_its_token(console: Console) -> None:
    token = console.keyring.mint(caveats(expires=console.clock.now() + 600))
    http = console.client()
    scope = await console.login(token, http)
    assert scope["expires_in"] == 600
    assert (await http.get("/", headers={"Accept": "application/json"})).status_code == 200
    console.clock.advance(600)
    reply = await http.get("/", headers={"Accept": "application/json"})
    assert reply.status_code == 401


async def test_another_consoles_cookie_opens_nothing(console: Console) -> None:
    other = Console(console.keyring)  # the same cluster (same keys), another console
    name = console.door.served.cookie
    mine = console.http.cookies[name]
    http = other.client()
    http.cookies.set(name, mine, domain=HOST)
    reply = await http.get("/", headers={"Accept": "application/json"})
    assert reply.status_code == 401
    shows_nothing(reply)
    # A forged id is no better.
    http.cookies.set(name, "x" * 43, domain=HOST)
    assert (await http.get("/", headers={"Accept": "application/json"})).status_code == 401
    assert len(other.sessions) == 0


async def test_a_revoked_token_ends_its_sessions_and_their_streams(console: Console) -> None:
    grant = console.keyring.verify(console.admin)
    async with stream(console, "/live/events") as s:
        await s.next("patch")
        console.flaps.revoked.add(grant.token_id)
        # Checked again at the next request after RECHECK seconds.
        assert (await console.get("/", as_json=True)).status_code == 200
        console.clock.advance(RECHECK)
        reply = await console.get("/", as_json=True)
        assert reply.status_code == 401
        assert "session ended: flaps refused the token" in reply.json()["reason"]
        await asyncio.wait_for(s.ended.wait(), T)  # the open stream ended with it
    assert len(console.sessions) == 0


async def test_a_flaps_that_does_not_answer_fails_the_request_not_the_session(
    console: Console,
) -> None:
    console.clock.advance(RECHECK)
    console.flaps.down = True
    reply = await console.get("/", as_json=True)
    assert reply.status_code == 503
    assert "flaps did not answer" in reply.json()["reason"]
    console.flaps.down = False
    assert (await console.get("/", as_json=True)).status_code == 200


# -- logging in, browsing, logging out -------------------------------------------------------------


async def test_a_login_with_the_form_then_browsing_then_logging_out(console: Console) -> None:
    http = console.client()
    redirected = await http.get("/apps/web")
    assert redirected.headers["location"] == "/login?next=%2Fapps%2Fweb"
    page = await http.get(redirected.headers["location"])
    assert 'name="next" value="/apps/web"' in page.text
    login_cookie = cookie_header(page, console.door.served.login_cookie)
    assert "HttpOnly" in login_cookie
    assert "SameSite=strict" in login_cookie
    # From the console's own page: its Referrer-Policy makes the browser send Origin null.
    with capture_logs() as logs:
        reply = await form_login(
            console,
            http,
            next_="/apps/web",
            headers={"Origin": "null", "Sec-Fetch-Site": "same-origin"},
        )
    assert reply.status_code == 303
    assert reply.headers["location"] == "/apps/web"
    cookie = cookie_header(reply, console.door.served.cookie)
    assert cookie.startswith("nonomad-console-80=")
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/", f"Max-Age={int(SESSION_TTL)}"):
        assert attribute in cookie
    assert "Secure" not in cookie  # plain HTTP here (see the TLS test)
    # The token is in no log line, no cookie, no answer; its id is.
    assert console.admin not in repr(logs) + cookie + reply.text
    (said,) = [e for e in logs if e["event"] == "console_login"]
    assert said["token_id"] == console.keyring.verify(console.admin).token_id

    app = await http.get("/apps/web")
    assert app.status_code == 200
    assert 'id="m-w0-web"' in app.text
    assert 'id="logout"' in app.text
    csrf = re.search(
        r'action="/logout"[^>]*>\s*<input type="hidden" name="csrf" value="([^"]+)"', app.text
    )
    assert csrf
    # A logout from another site, or without the form's token, is refused.
    evil = await http.post(
        "/logout", data={"csrf": csrf.group(1)}, headers={"Origin": "https://evil.example"}
    )
    assert evil.status_code == 403
    forged = await http.post("/logout", data={"csrf": "guess"}, headers={"Origin": ORIGIN})
    assert forged.status_code == 403
    assert (await http.get("/apps/web")).status_code == 200
    async with stream(console, "/live/fleet", http) as s:
        await s.next("patch")
        out = await http.post("/logout", data={"csrf": csrf.group(1)}, headers={"Origin": ORIGIN})
        assert out.status_code == 303
        assert out.headers["location"] == "/login"
        await asyncio.wait_for(s.ended.wait(), T)  # its streams end with it
    assert (await http.get("/apps/web")).status_code == 303
    assert len(console.sessions) == 1  # the fixture's own


async def test_the_one_time_login_url_opens_a_session(console: Console) -> None:
    code = await new_code(console)
    assert console.admin not in code
    http = console.client()
    # Opened from the terminal (a click, a pasted URL): no question asked.
    reply = await http.get(f"/login?code={code}&next=/events", headers={"Sec-Fetch-Site": "none"})
    assert reply.status_code == 303
    assert reply.headers["location"] == "/events"
    assert (await http.get("/events", headers={"Accept": "application/json"})).status_code == 200


@pytest.mark.parametrize(
    ("raw", "goes_to"),
    [
        ("/apps/web?page=2", "/apps/web?page=2"),
        ("//evil.example/", "/"),
        ("/\\evil.example", "/"),
        ("https://evil.example/", "/"),
        ("apps", "/"),
        ("", "/"),
    ],
)
async def test_after_a_login_the_browser_goes_to_a_page_of_the_console_only(
    console: Console, raw: str, goes_to: str
) -> None:
    reply = await form_login(console, console.client(), next_=raw)
    assert reply.status_code == 303
    assert reply.headers["location"] == goes_to


async def test_every_answer_carries_the_security_headers(console: Console) -> None:
    answers = [
        await console.get("/"),
        await console.get("/machines/w0-web", as_json=True),
        await console.client().get("/"),  # a redirect to the login
        await console.client().get("/login"),
        await console.http.get("/", headers={"Host": "evil.example"}),
        await console.http.get("/static/console.css"),
        await console.get("/nowhere"),
    ]
    for reply in answers:
        assert reply.headers["cache-control"] == "no-store", reply.url
        assert reply.headers["x-content-type-options"] == "nosniff"
        assert reply.headers["referrer-policy"] == "no-referrer"
        assert reply.headers["x-frame-options"] == "DENY"
        assert reply.headers["content-security-policy"] == CSP
        assert "strict-transport-security" not in reply.headers
    assert "frame-ancestors 'none'" in CSP
    assert "script-src 'self';" in CSP
    # Nothing inline for the policy to refuse: no script or style in a page's HTML.
    for reply in answers[:1] + answers[3:4]:
        assert "<script>" not in reply.text
        assert "style=" not in reply.text
    async with stream(console, "/live/fleet") as s:
        _status, headers = s.started.result()
        assert headers["cache-control"] == "no-store"
        assert headers["content-security-policy"] == CSP


async def test_over_tls_the_cookie_is_secure_and_host_only() -> None:
    c = Console()
    served = Served.of("127.0.0.1", 443, tls=True, names=[HOST])
    c.door = Door(served, c.sessions, c.codes, c.door.check, c.door.flaps)
    app = build(c.pages, c.live, c.closing, c.door)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"https://{HOST}")
    page = await http.get("/login")
    assert page.headers["strict-transport-security"] == "max-age=31536000"
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf
    reply = await http.post(
        "/login",
        data={"csrf": csrf.group(1), "token": c.admin},
        headers={"Origin": f"https://{HOST}"},
    )
    assert reply.status_code == 303, reply.text
    cookie = cookie_header(reply, "__Host-nonomad-console-443")
    assert "Secure" in cookie
    assert "Path=/" in cookie
    assert "Domain" not in cookie
    # The http:// origin is another origin.
    reply = await http.post("/login", data={}, headers={"Origin": f"http://{HOST}"})
    assert reply.status_code == 403
    c.sessions.close()


# -- what a session sees -------------------------------------------------------------------------


async def app_scoped(console: Console, *, apps: list[str], **more: Any) -> httpx.AsyncClient:
    """A client logged in with a read token of `apps` (and `more` caveats)."""
    token = console.keyring.mint(caveats(apps=apps, ops=["read"], **more))
    http = console.client()
    await console.login(token, http)
    return http


async def test_an_app_scoped_token_sees_only_its_app(console: Console) -> None:
    other = machine("w1-db", "db", "w1")
    console.replica.rows[other.id] = other
    http = await app_scoped(console, apps=["web"])

    async def get(path: str) -> httpx.Response:
        return await http.get(path, headers={"Accept": "application/json"})

    fleet = (await get("/")).json()
    assert fleet["workers"] == []
    assert fleet["regions"] == []
    assert fleet["apps"] == [{"name": "web", "machines": 3}]
    assert fleet["machines_by_state"] == {"started": 3}
    assert fleet["scope"]["apps"] == ["web"]
    assert fleet["scope"]["fleet"] is False
    assert (await get("/apps")).json()["apps"] == [{"name": "web", "machines": 3}]
    assert (await get("/apps/web")).status_code == 200
    assert (await get("/machines/w0-web")).status_code == 200
    html = (await http.get("/")).text
    assert 'id="fleet-hidden"' in html
    assert 'id="workers"' not in html
    assert "w1-db" not in html
    # Another app's pages and streams: 403, whether the app exists or not, nothing of it sent.
    for path in (
        "/apps/db",
        "/apps/nothing",
        "/machines/w1-db",
        "/events?app=db",
        "/live/apps/db",
        "/live/machines/w1-db",
        "/live/machines/w1-db/logs",
        "/live/events?app=db",
    ):
        reply = await get(path)
        assert reply.status_code == 403, path
        app = "nothing" if path == "/apps/nothing" else "db"
        assert reply.json()["reason"] == f'token caveat "apps = web" does not allow app {app}'
    assert console.flaps.following_logs == 0
    # The feed: its app's items only, no worker's.
    async with stream(console, "/live/events", http) as s:
        await s.next("patch")
        console.replica.changed(machine("w1-db", "db", "w1", state=STOPPED), 5, STARTED)
        console.replica.changed(machine("w0-web", "web", "w1", state=STOPPED), 6, STARTED)
        _, item = await s.next("feed")
        assert 'data-machine="w0-web"' in item
    events = (await get("/events")).json()["events"]
    assert {e["app"] for e in events} == {"web"}
    everything = (await console.json("/events"))["events"]
    assert {e["app"] for e in everything} == {"web", "db"}


async def test_an_app_scoped_fleet_stream_sends_no_worker(console: Console) -> None:
    http = await app_scoped(console, apps=["web"])
    async with stream(console, "/live/fleet", http) as s:
        first = await s.patch()
        assert "worker-w1" not in first["workers"]
        assert 'data-region="ams"' not in first["regions"]
        assert 'href="/apps/web"' in first["apps-list"]
        console.replica.worker_changed("w2", free_cpu=3000)
        console.replica.changed(machine("w9-db", "db", "w2"), 7, CREATED)
        console.replica.changed(machine("w3-web", "web", "w2"), 8, CREATED)
        while True:  # up to the apps list with its new machine (db's was never sent)
            kind, data = await s.next()
            assert kind != "feed" or "w9-db" not in data
            if kind == "patch":
                assert not any(k.startswith("worker-") for k in data), data
                if "apps-list" in data:
                    assert "db" not in data["apps-list"]
                    assert '<span class="muted">4</span>' in data["apps-list"]
                    break


async def test_a_token_of_several_apps_caveats_sees_where_they_meet(console: Console) -> None:
    """Every caveat must hold: `apps = db,web` then `apps = web,cache` is web's alone (and
    the token is checked at flaps on web, the app both allow)."""
    narrowed = attenuate(
        console.keyring.mint(caveats(apps=["db", "web"], ops=["read"])), ["apps = web,cache"]
    )
    scope = await console.login(narrowed, http := console.client())
    assert scope["apps"] == ["web"]
    fleet = (await http.get("/", headers={"Accept": "application/json"})).json()
    assert [a["name"] for a in fleet["apps"]] == ["web"]
    nothing = attenuate(console.keyring.mint(caveats(apps=["db"])), ["apps = web"])
    reply = await console.client().post(
        "/login", headers={"Authorization": f"Bearer {nothing}", "Accept": "application/json"}
    )
    assert reply.status_code == 403
    assert reply.json()["reason"].endswith("its apps caveats allow no app at all")


async def test_a_machine_scoped_token_sees_those_machines_only(console: Console) -> None:
    http = await app_scoped(console, apps=["web"], machines=["w0-web"])
    app = (await http.get("/apps/web", headers={"Accept": "application/json"})).json()
    assert [m["id"] for m in app["machines"]] == ["w0-web"]
    fleet = (await http.get("/", headers={"Accept": "application/json"})).json()
    assert fleet["apps"] == [{"name": "web", "machines": 1}]
    reply = await http.get("/machines/w1-web", headers={"Accept": "application/json"})
    assert reply.status_code == 403


async def test_a_session_holds_a_bounded_number_of_streams(console: Console) -> None:
    cap = console.sessions.streams_per_session
    async with contextlib.AsyncExitStack() as held:
        for _ in range(cap):
            s = await held.enter_async_context(stream(console, "/live/events"))
            await s.next("patch")
        reply = await console.get("/live/fleet", as_json=True)
        assert reply.status_code == 429
        assert reply.json()["reason"] == f"this session has {cap} live streams open"
        # Another session has its own.
        http = console.client()
        await console.login(http=http)
        async with stream(console, "/live/fleet", http) as s:
            await s.next("patch")
    async with stream(console, "/live/fleet") as s:  # all closed: room again
        await s.next("patch")


async def test_a_log_line_is_cut_to_its_bound(console: Console) -> None:
    async with stream(console, LOGS) as s:
        assert await s.next() == ("tail", [])
        assert await s.next() == ("line", "booted")
        await console.flaps.lines.put("x" * (LINE_MAX + 10))
        _, line = await s.next()
        assert line == "x" * LINE_MAX + " [console: 10 more characters not shown]"


def test_the_session_store_is_bounded() -> None:
    clock = ManualClock()
    sessions = Sessions(clock.now, max_sessions=3)
    scope = Scope(Grant("t", ()))
    opened = [sessions.open("tok", scope, Any)[0] for _ in range(3)]  # type: ignore[arg-type]
    assert sessions.get(opened[0]) is not None  # used: the first is now the most recent
    fourth, session4 = sessions.open("tok", scope, Any)  # type: ignore[arg-type]
    assert len(sessions) == 3
    assert sessions.get(opened[1]) is None  # the least recently used went
    assert sessions.get(opened[0]) is not None
    assert sessions.get(fourth) is session4
