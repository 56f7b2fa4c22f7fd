"""The edge answers for `<app>.<domain>` with that app's machines only, keeps its own headers
(`nonomad-*`) to itself, and lets a request pin a machine only with a token that may read it.

HttpProxy against real backends on 127.0.0.1 and the fake router, with the pin check the
proxy builds on flaps' answers about tokens (here flaps' own TokenServicer, called in
process: tests/proxy/test_pins.py); the router's own refusal of another app's machine is
checked on the real Router over fakes.
"""

from __future__ import annotations

import pytest

from model.tokens import Keyring, new_key_line
from proxy.errors import NoBackend
from proxy.http import HttpProxy
from proxy.pins import Grants, pin_check
from proxy.stats import Stats
from tests.proxy.http_support import DOMAIN, FakeRouter, TestBackend, echo, edge
from tests.proxy.support import flaps_verifies, fleet, machine, world

KEYS = Keyring.parse(new_key_line("k1"))
PIN = "nonomad-force-instance-id"


async def test_the_proxys_own_headers_never_reach_a_machine() -> None:
    web = await TestBackend("m-1", echo).start()
    try:
        async with edge(FakeRouter({"web": [web.backend()]})) as e:
            resp = await e.get(
                "web",
                headers=[
                    ("Nonomad-Machine-Id", "spoofed"),
                    ("nonomad-token", KEYS.mint([])),
                    ("nonomad-anything", "x"),
                    ("x-app-header", "kept"),
                ],
            )
    finally:
        await web.stop()
    assert resp.status == 200
    [seen] = web.requests
    names = [name.lower() for name, _ in seen.headers]
    assert not [n for n in names if n.startswith("nonomad-")], names
    assert seen.header("x-app-header") == "kept"
    assert resp.header("nonomad-machine-id") == "m-1"  # the proxy's answer, not the spoof


@pytest.mark.parametrize(
    ("token", "status", "reason"),
    [
        (None, 403, "needs a nonomad-token header"),
        ("garbage", 403, "not a nonomad token"),
        (KEYS.mint(["apps = api"]), 403, 'caveat "apps = api" does not allow app web'),
        (KEYS.mint(["apps = web", "ops = admin"]), 403, 'caveat "ops = admin"'),
        (KEYS.mint(["machines = m-1"]), 403, 'caveat "machines = m-1" does not allow machine'),
        (Keyring.parse(new_key_line("k1")).mint([]), 403, "bad signature"),
        (KEYS.mint(["apps = web", "ops = read"]), 200, ""),
    ],
)
async def test_a_pin_is_honoured_only_with_a_token_that_may_read_the_app(
    token: str | None, status: int, reason: str
) -> None:
    one, two = await TestBackend("m-1", echo).start(), await TestBackend("m-2", echo).start()
    headers = [(PIN, "m-2")] + ([("nonomad-token", token)] if token else [])
    try:
        router = FakeRouter({"web": [one.backend(), two.backend()]})
        async with edge(router, pin_check=pin_check(Grants(flaps_verifies(KEYS)))) as e:
            resp = await e.get("web", headers=headers)
    finally:
        await one.stop()
        await two.stop()
    assert resp.status == status, resp.text
    assert reason in resp.text
    if status == 200:
        assert resp.header("nonomad-machine-id") == "m-2"
    else:
        assert (one.requests, two.requests) == ([], [])


async def test_a_proxy_without_flaps_pins_nothing() -> None:
    one = await TestBackend("m-1", echo).start()
    try:
        async with edge(FakeRouter({"web": [one.backend()]}), pin_check=pin_check(None)) as e:
            pinned = await e.get("web", headers=[(PIN, "m-1"), ("nonomad-token", KEYS.mint([]))])
            plain = await e.get("web")
    finally:
        await one.stop()
    assert pinned.status == 403
    assert "no flaps to verify tokens with" in pinned.text
    assert plain.status == 200


async def test_an_app_is_answered_by_its_own_machines_only() -> None:
    rows = fleet(machine("w-1", app="web"), machine("a-1", app="api", worker="w2"))
    async with world(rows) as w:
        with pytest.raises(NoBackend, match="app web has no machine a-1"):
            await w.router.acquire("web", pinned="a-1")
        for _ in range(4):
            assert (await w.router.acquire("web")).machine_id == "w-1"
        assert (await w.router.acquire("api", pinned="a-1")).machine_id == "a-1"


async def test_the_pin_header_is_in_the_proxys_namespace() -> None:
    with pytest.raises(ValueError, match="must start with nonomad-"):
        HttpProxy(FakeRouter({}), Stats(), domain=DOMAIN, region="ams", pin_header="x-pin")
