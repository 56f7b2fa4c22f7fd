"""Attack 6 of issue 27 against a real cluster and the real `nonomad-console` process
(tests.console.cluster): any web page (DNS rebinding) or local user asked the console, with
`Host: evil.example` and no credentials, for every app's machines, env and live logs, and got
them. Now each way in without a login is refused with its status and serves nothing of the
cluster (not a machine id, not an env value); the operator's login works; a token of one app
sees that app only; a secret's value is on no page.
"""

from __future__ import annotations

import asyncio
import http.client
import ssl
import uuid
from pathlib import Path

import pytest

from flaps.v1 import machines_pb2 as m
from flyd.v1 import machine_pb2 as pb
from model.tokens import caveats
from tests.console.cluster import ConsoleProcess, Reply
from tests.harness import ServiceProcess, clean_env
from tests.proxy.support import ProxyFleet, T, eventually

ENV_VALUE = f"env-{uuid.uuid4().hex}"
SECRET = f"s3cret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def machines(cluster: tuple[ProxyFleet, ConsoleProcess]) -> dict[str, pb.Machine]:
    """A started machine of app `web` (with an env value and a secret) and one of `db`, both
    seen by the console."""
    fleet, console = cluster

    async def made() -> dict[str, pb.Machine]:
        await fleet.until_alive()
        config = pb.MachineConfig(
            image="demo:v1",
            guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
            services=[pb.ServiceConfig(internal_port=8080)],
            env={"GREETING": ENV_VALUE},
            secrets={"API_KEY": SECRET},
        )
        out = {}
        for app in ("web", "db"):
            request = m.CreateMachineRequest(app=app, region="ams", config=config)
            out[app] = (await fleet.machines().CreateMachine(request, timeout=T)).machine
        await eventually(
            lambda: {a["name"] for a in console.json("/apps")["apps"]} >= {"web", "db"},
            "the console seeing both apps",
        )
        return out

    return asyncio.run(made())


def nothing_of(reply: Reply, machines: dict[str, pb.Machine]) -> None:
    """The reply holds nothing of the cluster: no machine id, worker, env or secret value."""
    for text in (*(mm.id for mm in machines.values()), ENV_VALUE, SECRET, '"w1"', "worker-w"):
        assert text not in reply.text, f"{text!r} in a refusal: {reply.text[:300]}"


def paths(machines: dict[str, pb.Machine]) -> list[str]:
    web = machines["web"].id
    return [
        "/",
        "/apps",
        "/apps/web",
        f"/machines/{web}",
        "/events",
        "/live/fleet",
        "/live/apps/web",
        f"/live/machines/{web}",
        f"/live/machines/{web}/logs",
        "/live/events",
    ]


def test_another_host_gets_a_421_and_nothing_else(
    cluster: tuple[ProxyFleet, ConsoleProcess], machines: dict[str, pb.Machine]
) -> None:
    _, console = cluster
    for path in [*paths(machines), "/login", "/static/console.js"]:
        for session in (False, True):  # (a rebinding page has no cookie; this one has)
            reply = console.request(
                path,
                headers={"Host": "evil.example", "Accept": "application/json"},
                session=session,
            )
            assert reply.status == 421, (path, reply.status)
            assert reply.json()["reason"] == "this console does not serve host 'evil.example'"
            nothing_of(reply, machines)
    # Its own names pass: localhost with its port, as the browser's address bar has it.
    port = console.address.rsplit(":", 1)[1]
    assert console.request("/", headers={"Host": f"localhost:{port}"}).status == 200


def test_without_a_session_nothing_is_served(
    cluster: tuple[ProxyFleet, ConsoleProcess], machines: dict[str, pb.Machine]
) -> None:
    _, console = cluster
    for path in paths(machines):
        for accept in ("text/html", "application/json", "text/event-stream"):
            reply = console.request(path, headers={"Accept": accept}, session=False)
            page = accept != "application/json" and not path.startswith("/live/")
            assert reply.status == (303 if page else 401), (path, accept, reply.status)
            nothing_of(reply, machines)
        # A cookie that is not a session of this console's is no better.
        reply = console.request(
            path,
            headers={"Accept": "application/json", "Cookie": f"{cookie_name(console)}={'x' * 43}"},
            session=False,
        )
        assert reply.status == 401
        nothing_of(reply, machines)


def cookie_name(console: ConsoleProcess) -> str:
    return console.cookie.partition("=")[0]


def test_a_cross_site_login_and_bad_codes_are_refused(
    cluster: tuple[ProxyFleet, ConsoleProcess], machines: dict[str, pb.Machine]
) -> None:
    _, console = cluster
    csrf, form_cookie = console.csrf()
    body = console.form({"csrf": csrf, "token": console.admin_token})
    form = {"Content-Type": "application/x-www-form-urlencoded", "Cookie": form_cookie}
    for headers, reason in [
        ({"Origin": "https://evil.example"}, "Origin https://evil.example is not this console's"),
        ({"Origin": console.url, "Sec-Fetch-Site": "cross-site"}, "a cross-site request"),
        ({}, "a POST needs the Origin of this console's pages"),
    ]:
        reply = console.request(
            "/login",
            method="POST",
            body=body,
            headers={**form, **headers, "Accept": "application/json"},
            session=False,
        )
        assert reply.status == 403
        assert reply.json()["reason"].startswith(reason)
        assert "set-cookie" not in reply.headers
    # From its own page it works.
    ok = console.request(
        "/login",
        method="POST",
        body=body,
        headers={**form, "Origin": console.url},
        session=False,
    )
    assert ok.status == 303
    # A forged code, then a used one: 401, no session.
    url = console.login_url()
    code_path = url.removeprefix(console.url)
    typed = {"Sec-Fetch-Site": "none"}
    forged = console.request("/login?code=" + "A" * 32, headers=typed, session=False)
    assert forged.status == 401
    used_once = console.request(code_path, headers=typed, session=False)
    assert used_once.status == 303
    again = console.request(code_path, headers=typed, session=False)
    assert again.status == 401
    for reply in (forged, again):
        assert "login code: unknown, used or expired" in reply.text
        assert not any(k.startswith("nonomad-console-") for k in reply.cookies())
        nothing_of(reply, machines)
    # The admin token is in no URL, no answer, no line of the console's log.
    assert console.admin_token not in url
    assert console.admin_token not in console.proc.stderr_path.read_text()


def test_the_operator_browses_everything_without_a_secret_value(
    cluster: tuple[ProxyFleet, ConsoleProcess], machines: dict[str, pb.Machine]
) -> None:
    _, console = cluster
    web, db = machines["web"], machines["db"]
    fleet = console.json("/")
    assert {w["id"] for w in fleet["workers"]} == {"w1", "w2"}
    assert fleet["scope"] == {"token_id": fleet["scope"]["token_id"], "apps": ["*"], "fleet": True}
    shown = console.json(f"/machines/{web.id}")
    assert shown["config"]["env"] == {"GREETING": ENV_VALUE}
    assert shown["config"]["secrets"] == {"API_KEY": "<redacted>"}
    assert console.json(f"/machines/{db.id}")["machine"]["app"] == "db"
    for path in [*paths(machines)[:5], f"/machines/{db.id}"]:
        assert SECRET not in console.request(path).text
        assert SECRET not in console.request(path, headers={"Accept": "application/json"}).text
    # A live stream opens for the session.
    stream = console.request("/live/fleet", headers={"Accept": "text/event-stream"}, read=False)
    assert stream.status == 200
    assert stream.headers["Content-Type"].startswith("text/event-stream")
    assert stream.headers["Cache-Control"] == "no-store"


def test_an_app_token_sees_its_app_only(
    cluster: tuple[ProxyFleet, ConsoleProcess], machines: dict[str, pb.Machine]
) -> None:
    _, console = cluster
    token = console.security.keyring().mint(caveats(apps=["web"], ops=["read"]))
    web_only = console.with_session(token)
    fleet = web_only.json("/")
    assert (fleet["workers"], fleet["regions"]) == ([], [])
    assert [a["name"] for a in fleet["apps"]] == ["web"]
    assert web_only.json("/apps/web")["machines"][0]["id"] == machines["web"].id
    assert web_only.json(f"/machines/{machines['web'].id}")["machine"]["app"] == "web"
    db = machines["db"].id
    for path in (
        "/apps/db",
        f"/machines/{db}",
        "/events?app=db",
        "/live/apps/db",
        f"/live/machines/{db}",
        f"/live/machines/{db}/logs",
    ):
        status, reason = web_only.refusal(path)
        assert (status, reason) == (403, 'token caveat "apps = web" does not allow app db'), path
    events = web_only.json("/events")["events"]
    assert {e["app"] for e in events} <= {"web"}
    assert any(e["app"] == "db" for e in console.json("/events")["events"])
    # A token that may not read opens nothing.
    writer = console.security.keyring().mint(caveats(apps=["web"], ops=["create"]))
    reply = console.request(
        "/login",
        method="POST",
        headers={"Authorization": f"Bearer {writer}", "Accept": "application/json"},
        session=False,
    )
    assert reply.status == 403
    assert 'caveat "ops = create"' in reply.json()["reason"]


def test_over_https_the_cookie_is_secure_and_another_consoles_cookie_opens_nothing(
    cluster: tuple[ProxyFleet, ConsoleProcess], tmp_path: Path
) -> None:
    """A second console of the same cluster, serving HTTPS with a certificate of the cluster's
    CA (it names 127.0.0.1): its cookie is Secure and host-only (`__Host-`), and the first
    console's session is nothing to it."""
    fleet, first = cluster
    security = first.security
    assert fleet.flaps is not None
    cert = security.cert("console")
    second = ServiceProcess(
        "nonomad.console",
        [
            *("--listen", "127.0.0.1:0", "--flaps", fleet.flaps.address),
            *("--upstream", fleet.flaps.cluster_address),
            *("--https-cert", str(cert.cert), "--https-key", str(cert.key)),
            *security.console_args(),
        ],
        tmp_path / "console-https.log",
        env=clean_env(),
    ).start()
    try:
        host, port = second.address.rsplit(":", 1)
        context = ssl.create_default_context(cafile=str(security.ca))

        def ask(method: str, path: str, headers: dict[str, str]) -> http.client.HTTPResponse:
            conn = http.client.HTTPSConnection(host, int(port), timeout=T, context=context)
            conn.request(method, path, headers=headers)
            reply = conn.getresponse()
            reply.read()
            conn.close()
            return reply

        bearer = {"Authorization": f"Bearer {first.admin_token}", "Accept": "application/json"}
        login = ask("POST", "/login", bearer)
        assert login.status == 200
        cookies = login.headers.get_all("Set-Cookie") or []
        (session,) = [c for c in cookies if c.startswith("__Host-nonomad-console-")]
        assert session.startswith(f"__Host-nonomad-console-{port}=")
        for attribute in ("Secure", "HttpOnly", "SameSite=strict", "Path=/"):
            assert attribute in session
        assert login.headers["Strict-Transport-Security"] == "max-age=31536000"
        # (the login form's cookie is dropped with the attributes a __Host- cookie needs)
        (dropped,) = [c for c in cookies if c.startswith("__Host-nonomad-login-")]
        assert "Max-Age=0" in dropped
        assert "Secure" in dropped
        cookie = session.partition(";")[0]
        assert ask("GET", "/", {"Cookie": cookie, "Accept": "application/json"}).status == 200
        # The first console's session, presented here (under this console's cookie name): 401.
        foreign = f"__Host-nonomad-console-{port}={first.cookie.partition('=')[2]}"
        assert ask("GET", "/", {"Cookie": foreign, "Accept": "application/json"}).status == 401
        # And this one's at the first: 401 too.
        value = cookie.partition("=")[2]
        status, _ = first.refusal(
            "/", headers={"Cookie": f"{cookie_name(first)}={value}"}, session=False
        )
        assert status == 401
    finally:
        second.kill()
