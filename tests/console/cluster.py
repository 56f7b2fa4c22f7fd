"""A real local cluster with `nonomad-console` in front of it, for the browser tests and the
process tests: workers w1 (label side=a) and w2 (side=b) announcing to flaps, one proxy
following both, and the console following flaps' replica with its read-only token, secure as
`nonomad up` runs it. `ConsoleProcess` speaks HTTP to it as a browser or a program would: raw
requests (any Host, any header, no redirect followed), and a logged-in session's."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonomad.security import ClusterSecurity, provision
from tests.harness import ServiceProcess, clean_env
from tests.proxy.support import ProxyFleet, T, two_sides

__all__ = ["ConsoleProcess", "Reply", "console_cluster"]


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)

    def cookies(self) -> dict[str, str]:
        """The cookies it sets: name -> the whole Set-Cookie value."""
        return {
            value.partition("=")[0]: value for value in self.headers.get_all("set-cookie") or []
        }


@dataclass
class ConsoleProcess:
    """The console process and where it serves; `cookie` is the session `login` opened."""

    proc: ServiceProcess
    security: ClusterSecurity
    cookie: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.proc.address

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def request(
        self,
        path: str,
        *,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        session: bool = True,
        read: bool = True,
    ) -> Reply:
        """One request, nothing followed; with `session`, the session's cookie. `read` False
        reads the head only (a stream that does not end)."""
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=T)
        try:
            sent = dict(headers or {})
            if session and self.cookie:
                sent.setdefault("Cookie", self.cookie)
            conn.request(method, path, body=body, headers=sent)
            reply = conn.getresponse()
            return Reply(reply.status, reply.headers, reply.read() if read else b"")
        finally:
            conn.close()

    def login(self, token: str) -> dict[str, Any]:
        """Log in with `token` as a program does (`Authorization: Bearer`); the scope."""
        reply = self.request(
            "/login",
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            session=False,
        )
        assert reply.status == 200, reply.text
        (session,) = [v for k, v in reply.cookies().items() if k.startswith("nonomad-console-")]
        self.cookie = session.partition(";")[0]
        return dict(reply.json())

    def with_session(self, token: str) -> ConsoleProcess:
        """Another client of the same console, logged in with `token`."""
        other = ConsoleProcess(self.proc, self.security)
        other.login(token)
        return other

    def login_url(self, token: str | None = None) -> str:
        """A one-time login URL for `token` (the admin's), as `nonomad up` asks for one."""
        from nonomad.console.login import login_url

        return login_url(self.url, token or self.admin_token)

    @property
    def admin_token(self) -> str:
        return self.security.admin_token.read_text().strip()

    def json(self, path: str) -> Any:
        """The page's JSON twin, with the session."""
        reply = self.request(path, headers={"Accept": "application/json"})
        assert reply.status == 200, (path, reply.status, reply.text)
        assert reply.headers["Content-Type"].startswith("application/json")
        return reply.json()

    def refusal(self, path: str, **kwargs: Any) -> tuple[int, str]:
        """The status and reason of a request the console must refuse."""
        headers = {"Accept": "application/json", **kwargs.pop("headers", {})}
        reply = self.request(path, headers=headers, **kwargs)
        assert reply.status >= 400, (path, reply.status)
        return reply.status, str(reply.json()["reason"])

    def csrf(self) -> tuple[str, str]:
        """A login form's CSRF token and its cookie (as a browser that opened the form has)."""
        page = self.request("/login", session=False)
        found = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert found, page.text
        (cookie,) = page.cookies().values()
        return found.group(1), cookie.partition(";")[0]

    def form(self, fields: dict[str, str]) -> bytes:
        return urllib.parse.urlencode(fields).encode()


def console_cluster(tmp: Path, image_source: Path) -> Iterator[tuple[ProxyFleet, ConsoleProcess]]:
    """The cluster of the module docstring, for a module-scoped fixture; the console's
    session is the admin's."""
    security = provision(tmp / "security", ["flaps", "proxy", "console"])
    prefix = f"nonomad-test-{uuid.uuid4().hex[:8]}"
    fleet = ProxyFleet(tmp, image_source, prefix=prefix, security=security)
    console = None
    try:
        flaps = two_sides(fleet, proxies=1)
        console = ServiceProcess(
            "nonomad.console",
            [
                "--listen",
                "127.0.0.1:0",
                "--flaps",
                flaps.address,
                "--upstream",
                flaps.cluster_address,
                "--proxy",
                fleet.proxies[0].address,
                *security.console_args(),
            ],
            tmp / "console.log",
            env=clean_env(),
        ).start()
        process = ConsoleProcess(console, security)
        process.login(process.admin_token)  # (`json` and `refusal` ask as the operator)
        yield fleet, process
    finally:
        if console is not None:
            console.kill()
        asyncio.run(fleet.close())
