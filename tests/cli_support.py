"""The `nonomad` CLI run as a subprocess, and `nonomad up --demo` started and stopped: what
test_cli.py and e2e/test_tenants.py stand on."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests import host_ports
from tests.harness import REPO_ROOT, clean_env

NONOMAD = [sys.executable, "-c", "from nonomad.cli import main; main()"]


def nonomad(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NONOMAD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=clean_env(),
        check=False,
    )


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def console_login(url: str) -> str:
    """Open a one-time login URL as a browser does from the terminal (`Sec-Fetch-Site:
    none`); the session cookie it sets, as a Cookie header."""
    opener = urllib.request.build_opener(NoRedirect)
    ask = urllib.request.Request(url, headers={"Sec-Fetch-Site": "none"})
    with pytest.raises(urllib.error.HTTPError) as redirected:
        opener.open(ask, timeout=10)
    with redirected.value as reply:
        assert reply.code == 303
        cookies = reply.headers.get_all("Set-Cookie")
    (session,) = [c for c in cookies if c.startswith("nonomad-console-")]
    assert "HttpOnly" in session
    assert "SameSite=strict" in session
    return session.partition(";")[0]


def up_demo(state: Path) -> tuple[subprocess.Popen[str], str]:
    """`nonomad up --demo` of one region of two workers (the edge and the console on free
    ports, machines' host ports a block of this test worker's), read until it says it is
    running: the process (`stop_up` ends it) and what it printed."""
    base_port = host_ports.block(200).start  # 100 for each of its 2 workers
    up = subprocess.Popen(
        [
            *NONOMAD, "--state-dir", str(state), "up", "--demo", "--regions", "ams",
            "--workers-per-region", "2", "--proxy-port", "0", "--console-port", "0",
            "--base-port", str(base_port),
        ],
        cwd=REPO_ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    assert up.stdout is not None
    out: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not out or not out[-1].startswith("running;"):
            assert time.monotonic() < deadline, "".join(out)
            out.append(up.stdout.readline())
            assert out[-1], "".join(out)
    except BaseException:
        stop_up(up)
        raise
    return up, "".join(out)


def stop_up(up: subprocess.Popen[str], reader: threading.Thread | None = None) -> None:
    """End an `up_demo` still running (SIGTERM, as Ctrl-C does), then let go of its output
    (after `reader`, a thread reading the rest of it, has seen its end)."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(30)
    if reader is not None and reader.ident is not None:
        reader.join(30)
    assert up.stdout is not None
    up.stdout.close()
