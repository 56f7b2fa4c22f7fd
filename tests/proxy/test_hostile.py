"""The edge against hostile clients (issue 19): absolute-form targets and Host ports (defect 7),
and one client holding more idle connections than the proxy's cap (defect 8)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.limits import Limits
from tests.proxy.http_support import DOMAIN, FakeRouter, Start, edge, eventually

# -- the request target ------------------------------------------------------------------------


async def test_an_absolute_form_request_is_routed_by_its_authority(start: Start) -> None:
    web = await start("m-web")
    other = await start("m-other")
    router = FakeRouter({"web": [web.backend()], "other": [other.backend()]})
    async with edge(router) as e:
        client = await e.client()
        # No Host: the authority names the app, and the machine gets the origin form.
        await client.send(f"GET http://other.{DOMAIN}/a/b?c=1 HTTP/1.1\r\n\r\n".encode())
        resp = await client.response()
        assert resp.status == 200
        assert resp.header("nonomad-machine-id") == "m-other"
        seen = resp.json()
        assert seen["target"] == "/a/b?c=1"
        assert ["Host", f"other.{DOMAIN}"] in seen["headers"]


async def test_an_absolute_form_request_whose_host_disagrees_is_refused(start: Start) -> None:
    web = await start("m-web")
    other = await start("m-other")
    router = FakeRouter({"web": [web.backend()], "other": [other.backend()]})
    async with edge(router) as e:
        client = await e.client()
        await client.send(
            f"GET http://other.{DOMAIN}/ HTTP/1.1\r\nHost: web.{DOMAIN}\r\n\r\n".encode()
        )
        resp = await client.response()
        assert resp.status == 400
        assert b"authority" in resp.body
        assert web.requests == []
        assert other.requests == []


@pytest.mark.parametrize("port", ["99999", "0", "65536", "-1", "8x", "123456"])
async def test_a_host_port_outside_1_to_65535_is_refused(start: Start, port: str) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        resp = await (await e.client()).request(f"web.{DOMAIN}:{port}")
        assert resp.status == 400
        assert b"port" in resp.body
        assert web.requests == []


async def test_a_host_with_a_valid_port_is_served(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        assert (await client.request(f"web.{DOMAIN}:65535")).status == 200
        assert (await client.request(f"web.{DOMAIN}:1")).status == 200


@pytest.mark.parametrize("app", ["web\t", "-web", "web-", "we_b"])
async def test_a_host_whose_app_is_not_a_name_names_no_app(start: Start, app: str) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        assert (await e.get(app)).status in (400, 404)
        assert web.requests == []


# -- connections -------------------------------------------------------------------------------


async def test_a_client_over_its_own_limit_is_refused(start: Start) -> None:
    web = await start("m-web")
    limits = Limits(max_connections_per_client=2)
    async with edge(FakeRouter({"web": [web.backend()]}), limits) as e:
        held = [await e.client(), await e.client()]
        await eventually(lambda: e.proxy.connections == 2, "two connections")
        extra = await e.client()
        assert (await extra.response()).status == 503
        assert (await held[0].request(f"web.{DOMAIN}")).status == 200
        other = await e.client("127.0.0.2")  # another client is not held to this one's limit
        assert (await other.request(f"web.{DOMAIN}")).status == 200


async def test_at_the_cap_an_idle_connection_of_the_heaviest_client_makes_room(
    start: Start,
) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), Limits(max_connections=2)) as e:
        held = [await e.client("127.0.0.2"), await e.client("127.0.0.2")]
        await eventually(lambda: e.proxy.connections == 2, "two connections")
        newcomer = await e.client()
        assert (await newcomer.request(f"web.{DOMAIN}")).status == 200
        assert e.proxy.connections == 2
        # One of the idle ones was cut off: it reads the end of its connection.
        reads = [asyncio.ensure_future(c.reader.read(1)) for c in held]
        done, pending = await asyncio.wait(reads, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert [t.result() for t in done] == [b""]
        for task in pending:
            task.cancel()


async def test_one_client_holding_more_idle_connections_than_the_cap_starves_nobody(
    start: Start,
) -> None:
    """The issue's repro, scaled down: one address opens more idle connections than the
    proxy's global cap (its own limit is above the cap), and another client is still served
    on every try."""
    web = await start("m-web")
    limits = Limits(max_connections=20, max_connections_per_client=64)
    async with edge(FakeRouter({"web": [web.backend()]}), limits) as e:
        hog = [await e.client("127.0.0.3") for _ in range(30)]
        await eventually(lambda: e.proxy.connections == 20, "the cap reached")
        for _ in range(5):
            normal = await e.client()
            assert (await normal.request(f"web.{DOMAIN}")).status == 200
            await normal.close()
        assert len(hog) == 30
        assert e.proxy.connections <= 20


async def test_when_every_connection_is_busy_a_newcomer_is_refused(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), Limits(max_connections=1)) as e:
        busy = await e.client("127.0.0.2")
        await busy.send(f"GET / HTTP/1.1\r\nHost: web.{DOMAIN}\r\n".encode())  # head unfinished
        await eventually(lambda: e.proxy.connections == 1, "one connection")
        extra = await e.client()
        assert (await extra.response()).status == 503
