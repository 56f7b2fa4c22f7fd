"""The proxy's data plane against real backends on 127.0.0.1 and a fake router."""

from __future__ import annotations

import asyncio
import http.client

import pytest

from proxy.limits import Limits
from proxy.stats import Stats
from tests.proxy.http_support import (
    DOMAIN,
    WAIT,
    Exchange,
    FakeRouter,
    RawClient,
    Start,
    backend_for,
    build_request,
    chunk,
    dead_port,
    echo,
    edge,
    eventually,
    gated,
)

# Every test runs twice: through the connection's task and from the parser callback.
pytestmark = pytest.mark.usefixtures("router_path")


# -- routing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "machine"),
    [
        (f"web.{DOMAIN}", "m-web"),
        (f"API.{DOMAIN.upper()}:8080", "m-api"),  # case-insensitive, port ignored
        (f"api.{DOMAIN}.", "m-api"),  # a fully qualified name
    ],
)
async def test_host_selects_the_app(start: Start, host: str, machine: str) -> None:
    web, api = await start("m-web"), await start("m-api")
    router = FakeRouter({"web": [web.backend("web")], "api": [api.backend("api")]})
    async with edge(router) as e:
        client = await e.client()
        resp = await client.request(host, "/hello?x=1")
        await client.close()
    assert resp.status == 200
    assert resp.header("nonomad-machine-id") == machine
    assert resp.json()["target"] == "/hello?x=1"


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("web.elsewhere.test", "expected <app>.nonomad.test"),
        (f"a.b.{DOMAIN}", "expected <app>.nonomad.test"),
        (DOMAIN, "expected <app>.nonomad.test"),
        (f"nope.{DOMAIN}", "no app named 'nope'"),  # the router does not know it
    ],
)
async def test_unknown_app_is_404_with_a_reason(start: Start, host: str, reason: str) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        resp = await client.request(host)
        # the connection is still good for the next request
        again = await client.request(f"web.{DOMAIN}")
        await client.close()
    assert resp.status == 404
    assert reason in resp.text
    assert again.status == 200


async def test_pin_header_picks_the_machine(start: Start) -> None:
    one, two = await start("m-1"), await start("m-2")
    router = FakeRouter({"web": [one.backend(), two.backend()]})
    async with edge(router) as e:
        client = await e.client()
        for _ in range(4):
            resp = await client.request(
                f"web.{DOMAIN}", headers=[("nonomad-force-instance-id", "m-2")]
            )
            assert resp.header("nonomad-machine-id") == "m-2"
        missing = await client.request(
            f"web.{DOMAIN}", headers=[("nonomad-force-instance-id", "m-9")]
        )
        await client.close()
    assert len(two.requests) == 4
    assert not one.requests
    assert missing.status == 503


async def test_no_backend_is_503_with_the_reason(start: Start) -> None:
    web = await start("m-web")
    router = FakeRouter({"web": [web.backend()]}, no_backend_reason="all machines over hard limit")
    async with edge(router) as e:
        resp = await e.get("web")
    assert resp.status == 503
    assert "all machines over hard limit" in resp.text


# -- keep-alive and connection reuse --------------------------------------------------------------


async def test_keep_alive_on_both_sides(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        for _ in range(3):  # three client connections, one after the other
            client = await e.client()
            for i in range(5):
                resp = await client.request(f"web.{DOMAIN}", f"/{i}")
                assert resp.status == 200
            await client.close()
        assert e.proxy.idle_upstream_connections == 1
    assert len(web.requests) == 15
    assert web.connections == 1  # every request went over the same pooled connection


async def test_a_stdlib_client_keeps_its_connection(start: Start) -> None:
    async def mixed(ex: Exchange) -> None:
        if ex.seen.target == "/chunked":
            ex.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            ex.writer.write(chunk(b"in ") + chunk(b"pieces") + b"0\r\n\r\n")
        else:
            ex.respond(200, (await ex.read_body()) or b"plain")

    web = await start("m-web", mixed)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:

        def session() -> list[bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=WAIT)
            headers = {"Host": f"web.{DOMAIN}"}
            bodies = []
            try:
                for target, body in [("/", None), ("/chunked", None), ("/post", b"sent")]:
                    conn.request("POST" if body else "GET", target, body=body, headers=headers)
                    bodies.append(conn.getresponse().read())
            finally:
                conn.close()
            return bodies

        bodies = await asyncio.to_thread(session)
    assert bodies == [b"plain", b"in pieces", b"sent"]
    assert web.connections == 1


async def test_pipelined_requests_are_answered_in_order(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(b"".join(build_request(f"web.{DOMAIN}", f"/{i}") for i in range(5)))
        targets = [(await client.response()).json()["target"] for _ in range(5)]
        await client.close()
    assert targets == [f"/{i}" for i in range(5)]


async def test_connection_close_is_honoured_both_ways(start: Start) -> None:
    async def closing(ex: Exchange) -> bool:
        ex.respond(200, b"bye", [("Connection", "close")])
        return False

    web = await start("m-web", closing)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        first = await client.request(f"web.{DOMAIN}")
        second = await client.request(f"web.{DOMAIN}", headers=[("Connection", "close")])
        assert await client.closed()
    assert first.status == second.status == 200
    assert first.header("connection") is None  # the machine's close is not the client's
    assert second.header("connection") == "close"
    assert web.connections == 2  # the machine closed after each: no reuse
    assert all(r.header("connection") is None for r in web.requests)


async def test_pooled_connection_closed_by_the_machine_is_not_used(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        assert (await e.get("web")).status == 200
        await web.stop()  # drops the idle pooled connection
        web2 = await start("m-web")
        e.router.apps["web"] = [web2.backend()]
        resp = await e.get("web")
    assert resp.status == 200
    assert web2.connections == 1


# -- bodies -------------------------------------------------------------------------------------


async def test_chunked_request_body_is_streamed(start: Start) -> None:
    got_first = asyncio.Event()

    async def reader(ex: Exchange) -> None:
        size = 0
        async for data in ex.chunks():
            size += len(data)
            got_first.set()
        ex.respond(200, str(size).encode())

    web = await start("m-web", reader)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(
            build_request(
                f"web.{DOMAIN}", method="POST", headers=[("Transfer-Encoding", "chunked")]
            )
            + chunk(b"a" * 1000)
        )
        # The machine sees the first piece while the rest has not even been sent.
        async with asyncio.timeout(WAIT):
            await got_first.wait()
        for _ in range(20):
            await client.send(chunk(b"b" * 50_000))
        await client.send(b"0\r\n\r\n")
        resp = await client.response()
        await client.close()
    assert resp.status == 200
    assert resp.text == str(1000 + 20 * 50_000)
    assert web.requests[0].header("transfer-encoding") == "chunked"


async def test_content_length_request_body_is_streamed(start: Start) -> None:
    got_some = asyncio.Event()

    async def reader(ex: Exchange) -> None:
        size = 0
        async for data in ex.chunks():
            size += len(data)
            got_some.set()
        ex.respond(200, str(size).encode())

    web = await start("m-web", reader)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        total = 2_000_000
        await client.send(
            build_request(f"web.{DOMAIN}", method="PUT", headers=[("Content-Length", str(total))])
            + b"x" * 1000
        )
        async with asyncio.timeout(WAIT):
            await got_some.wait()
        await client.send(b"y" * (total - 1000))
        resp = await client.response()
        await client.close()
    assert resp.text == str(total)


async def test_chunked_response_is_streamed(start: Start) -> None:
    client_got_first = asyncio.Event()

    async def streamer(ex: Exchange) -> None:
        ex.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        ex.writer.write(chunk(b"first "))
        await ex.writer.drain()
        async with asyncio.timeout(WAIT):
            await client_got_first.wait()  # the client has it before the rest exists
        ex.writer.write(chunk(b"second") + b"0\r\n\r\n")

    web = await start("m-web", streamer)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(build_request(f"web.{DOMAIN}"))
        resp = await client.response(on_chunk=lambda _: client_got_first.set())
        again = await client.request(f"web.{DOMAIN}")  # the stream ended cleanly: reusable
        await client.close()
    assert resp.body == b"first second"
    assert resp.header("transfer-encoding") == "chunked"
    assert again.status == 200
    assert web.connections == 1


async def test_response_delimited_by_close_is_rechunked(start: Start) -> None:
    async def old_style(ex: Exchange) -> bool:
        ex.writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        return False

    web = await start("m-web", old_style)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        resp = await client.request(f"web.{DOMAIN}")
        again = await client.request(f"web.{DOMAIN}")
        await client.close()
    assert resp.body == again.body == b"until the end"
    assert resp.header("transfer-encoding") == "chunked"


async def test_http10_client_gets_a_close_delimited_body(start: Start) -> None:
    async def chunky(ex: Exchange) -> None:
        ex.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        ex.writer.write(chunk(b"hello") + b"0\r\n\r\n")

    web = await start("m-web", chunky)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(f"GET / HTTP/1.0\r\nHost: web.{DOMAIN}\r\n\r\n".encode())
        resp = await client.response()  # no framing: read to EOF
        await client.close()
    assert resp.body == b"hello"
    assert resp.header("transfer-encoding") is None


@pytest.mark.parametrize("status", [204, 304])
async def test_head_and_bodiless_statuses(start: Start, status: int) -> None:
    async def handler(ex: Exchange) -> None:
        if ex.seen.method == "HEAD":
            ex.respond(200, headers=[("Content-Length", "42")], length=False)
        elif ex.seen.target == "/empty":
            ex.respond(status, length=False)
        else:
            ex.respond(200, b"body")

    web = await start("m-web", handler)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        head = await client.request(f"web.{DOMAIN}", method="HEAD")
        empty = await client.request(f"web.{DOMAIN}", "/empty")
        after = await client.request(f"web.{DOMAIN}")  # same connections, nothing left over
        await client.close()
    assert head.status == 200
    assert head.header("content-length") == "42"
    assert empty.status == status
    assert after.body == b"body"
    assert web.connections == 1


# -- upgrade ------------------------------------------------------------------------------------


async def test_upgrade_splices_both_ways(start: Start) -> None:
    async def ws_echo(ex: Exchange) -> bool:
        assert ex.seen.header("upgrade") == "websocket"
        ex.writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\n\r\nhello"
        )
        while data := await ex.reader.read(65536):
            ex.writer.write(data.upper())
        return False

    web = await start("m-web", ws_echo)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(
            build_request(
                f"web.{DOMAIN}",
                "/ws",
                headers=[("Connection", "Upgrade"), ("Upgrade", "websocket")],
            )
            + b"early bytes;"
        )
        resp = await client.response(head=True)
        assert resp.status == 101
        assert resp.header("upgrade") == "websocket"
        async with asyncio.timeout(WAIT):
            assert await client.reader.readexactly(5) == b"hello"
            assert await client.reader.readexactly(12) == b"EARLY BYTES;"
            for word in (b"ping", b"more"):
                await client.send(word)
                assert await client.reader.readexactly(4) == word.upper()
        await client.close()
        await eventually(lambda: e.router.balanced, "the upgrade was released")
    assert e.router.released[0].ok


# -- headers ------------------------------------------------------------------------------------


async def test_forwarded_headers_trace_and_hop_by_hop(start: Start) -> None:
    web = await start("m-web")
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        resp = await e.get(
            "web",
            headers=[
                ("X-Forwarded-For", "203.0.113.7"),  # a client's word: replaced
                ("X-Forwarded-Proto", "https"),
                ("traceparent", trace),
                ("Keep-Alive", "timeout=5"),
                ("TE", "trailers"),
                ("Proxy-Connection", "keep-alive"),
                ("Connection", "keep-alive, X-Secret"),
                ("X-Secret", "hop"),
                ("X-App", "kept"),
            ],
        )
    seen = web.requests[0]
    assert resp.header("nonomad-machine-id") == "m-web"
    assert seen.header("x-forwarded-for") == "127.0.0.1"
    assert seen.header("x-real-ip") == "127.0.0.1"
    assert seen.header("x-forwarded-proto") == "http"
    assert seen.header("x-forwarded-host") == f"web.{DOMAIN}"
    assert seen.header("forwarded") == f'for=127.0.0.1;proto=http;host="web.{DOMAIN}"'
    assert seen.header("host") == f"web.{DOMAIN}"
    assert seen.header("traceparent") == trace
    assert seen.header("x-app") == "kept"
    for hop in ("keep-alive", "te", "proxy-connection", "connection", "x-secret", "upgrade"):
        assert seen.header(hop) is None, hop


# -- failures and retries -----------------------------------------------------------------------


async def test_get_is_retried_on_another_machine_when_refused(start: Start) -> None:
    good = await start("m-good")
    router = FakeRouter({"web": [backend_for("m-dead", dead_port()), good.backend()]})
    async with edge(router) as e:
        resp = await e.get("web")
    assert resp.status == 200
    assert resp.header("nonomad-machine-id") == "m-good"
    assert [(r.machine_id, r.ok, r.connect_failed) for r in router.released] == [
        ("m-dead", False, True),
        ("m-good", True, False),
    ]


async def test_post_is_not_retried(start: Start) -> None:
    good = await start("m-good")
    router = FakeRouter({"web": [backend_for("m-dead", dead_port()), good.backend()]})
    async with edge(router) as e:
        resp = await e.get("web", method="POST", body=b"pay once")
    assert resp.status == 502
    assert "m-dead" in resp.text
    assert len(good.requests) <= 1
    assert router.acquired == ["m-dead"]
    assert router.released[0].connect_failed


async def test_stale_pooled_connection_replays_get_but_not_post(start: Start) -> None:
    served: dict[int, int] = {}

    async def drops_second(ex: Exchange) -> bool | None:
        n = served.get(id(ex.writer), 0)
        served[id(ex.writer)] = n + 1
        if n == 1:  # the second request on a connection: gone, as if it idled out just then
            ex.writer.transport.abort()
            return False
        ex.respond(200, ex.seen.method.encode())
        return None

    web = await start("m-web", drops_second)
    router = FakeRouter({"web": [web.backend()]})
    async with edge(router) as e:
        first = await e.get("web")
        replayed = await e.get("web")  # dropped on the pooled connection, sent again
        posted = await e.get("web", method="POST", body=b"once")  # dropped: never again
    assert (first.status, replayed.status, replayed.text) == (200, 200, "GET")
    assert posted.status == 502
    assert [r.method for r in web.requests] == ["GET", "GET", "GET", "POST"]
    assert router.balanced
    assert len(router.acquired) == 3  # the replay went to the machine already acquired


async def test_retries_are_bounded(start: Start) -> None:
    router = FakeRouter({"web": [backend_for(f"m-{i}", dead_port()) for i in range(5)]})
    async with edge(router, Limits(max_retries=2)) as e:
        resp = await e.get("web")
    assert resp.status == 502
    assert len(router.acquired) == 3
    assert len(set(router.acquired)) == 3  # each try excluded the ones before
    assert router.balanced


async def test_slow_machine_is_504(start: Start) -> None:
    async def slow(ex: Exchange) -> None:
        await asyncio.sleep(WAIT)

    web = await start("m-slow", slow)
    async with edge(
        FakeRouter({"web": [web.backend()]}), Limits(upstream_response_timeout=0.2)
    ) as e:
        resp = await e.get("web")
    assert resp.status == 504
    assert "m-slow" in resp.text
    assert e.router.released[0].ok is False


async def test_machine_dying_mid_request_is_502(start: Start) -> None:
    async def crash(ex: Exchange) -> bool:
        ex.writer.transport.abort()
        return False

    web = await start("m-crash", crash)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        resp = await e.get("web", method="POST", body=b"x")
    assert resp.status == 502
    assert "without a response" in resp.text


# -- hostile clients ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: web.nonomad.test\r\nContent-Length: x\r\n\r\n", 400),
        (b"GET /\x01 HTTP/1.1\r\nHost: web.nonomad.test\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: web.nonomad.test\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: web.nonomad.test\r\nX-Big: " + b"a" * 40_000, 431),
        (b"GET / HTTP/1.1\r\n" + b"X-Many: 1234567890\r\n" * 2000 + b"\r\n", 431),
    ],
    ids=[
        "garbage",
        "bad-length",
        "bad-target",
        "two-hosts",
        "big-header",
        "endless-header",
        "many",
    ],
)
async def test_malformed_requests_are_refused_then_closed(
    start: Start, raw: bytes, status: int
) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(raw)
        resp = await client.response()
        assert await client.closed()
    assert resp.status == status
    assert resp.header("connection") == "close"
    assert not web.requests


async def test_body_over_the_limit_by_content_length_is_413(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), Limits(max_body_bytes=1000)) as e:
        client = await e.client()
        await client.send(
            build_request(f"web.{DOMAIN}", method="POST", headers=[("Content-Length", "5000")])
        )
        resp = await client.response()
        assert await client.closed()
    assert resp.status == 413
    assert not web.requests  # refused before anything was sent on


async def test_chunked_body_over_the_limit_is_aborted(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), Limits(max_body_bytes=1000)) as e:
        client = await e.client()
        await client.send(
            build_request(
                f"web.{DOMAIN}", method="POST", headers=[("Transfer-Encoding", "chunked")]
            )
            + chunk(b"a" * 600)
        )
        await client.send(chunk(b"b" * 600))
        resp = await client.response()
        assert await client.closed()
        await eventually(lambda: e.router.balanced, "released")
    assert resp.status == 413
    assert all(len(r.body) < 1200 for r in web.requests)


async def test_slowloris_head_is_cut_off(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), Limits(header_timeout=0.3)) as e:
        client = await e.client()
        await client.send(b"GET / HTTP/1.1\r\nHost: web.nonomad.test\r\nX-Slow: ")
        assert await client.closed()
        silent = await e.client()  # connects and never says a word
        assert await silent.closed()


async def test_idle_keep_alive_connection_is_closed(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), Limits(idle_keepalive=0.2)) as e:
        client = await e.client()
        assert (await client.request(f"web.{DOMAIN}")).status == 200
        assert await client.closed()


async def test_hostile_connections_do_not_disturb_others(start: Start) -> None:
    gate = asyncio.Event()

    web = await start("m-web", gated(gate, b"fine"))
    async with edge(FakeRouter({"web": [web.backend()]}), Limits(header_timeout=0.3)) as e:
        normal = await e.client()
        await normal.send(build_request(f"web.{DOMAIN}"))  # in flight while the others misbehave
        slow = await e.client()
        await slow.send(b"GET / HTTP/1.1\r\nHost: web.nonomad.test\r\n")
        junk = await e.client()
        await junk.send(b"\x00\xff" * 1000)
        big = await e.client()
        await big.send(b"GET / HTTP/1.1\r\nX: " + b"z" * 100_000)
        assert (await junk.response()).status == 400
        assert (await big.response()).status == 431
        assert await slow.closed()
        gate.set()
        resp = await normal.response()
        assert resp.body == b"fine"
        assert (await normal.request(f"web.{DOMAIN}")).status == 200
        await normal.close()


# -- bookkeeping ----------------------------------------------------------------------------------


async def test_release_once_per_acquire_and_stats_count_statuses(start: Start) -> None:
    async def mixed(ex: Exchange) -> None:
        status = int(ex.seen.target.strip("/") or 200)
        ex.respond(status, b"x")

    web = await start("m-web", mixed)
    router = FakeRouter({"web": [web.backend(), backend_for("m-dead", dead_port())]})
    async with edge(router) as e:
        client = await e.client()
        for target in ["/200", "/404", "/500", "/201", "/200"]:
            await client.request(f"web.{DOMAIN}", target)
        await client.request(f"nope.{DOMAIN}")
        await client.request(f"web.{DOMAIN}", method="POST", body=b"1")  # lands on either
        await client.request(f"web.{DOMAIN}", method="POST", body=b"2")
        await client.close()
        stats: Stats = e.stats
        await eventually(lambda: stats.requests == 8, "all recorded")
    assert router.balanced
    assert len(router.released) == len(router.acquired)
    snap = stats.snapshot()
    assert snap["by_status"]["200"] == 3  # two GETs and the POST that met the live machine
    assert snap["by_status"]["201"] == 1
    assert snap["by_status"]["404"] == 2  # one from the machine, one unknown app
    assert snap["by_status"]["500"] == 1
    assert snap["by_status"]["502"] == 1  # the POST that met the dead machine
    assert snap["latency_ms"]["p99"] is not None


def test_stats_window_is_bounded_and_percentiles_are_right() -> None:
    stats = Stats(window=100)
    for ms in range(1, 1001):
        stats.record("web", 200, ms / 1000)
    snap = stats.snapshot()
    assert snap["requests"] == 1000
    assert snap["latency_window"] == 128  # rounded up to a power of two
    assert snap["latency_ms"] == {"p50": 936.0, "p90": 988.0, "p99": 999.0}
    stats.cold_start()
    stats.failover()
    assert (stats.snapshot()["cold_starts"], stats.snapshot()["failovers"]) == (1, 1)
    assert Stats().snapshot()["latency_ms"]["p50"] is None


async def test_close_lets_requests_in_flight_finish(start: Start) -> None:
    gate = asyncio.Event()

    web = await start("m-web", gated(gate, b"done"))
    router = FakeRouter({"web": [web.backend()]})
    async with edge(router) as e:
        idle = await e.client()
        busy = await e.client()
        await busy.send(build_request(f"web.{DOMAIN}"))
        await eventually(lambda: len(web.requests) == 1, "request in flight")
        closing = asyncio.create_task(e.proxy.close(grace=WAIT))
        assert await idle.closed()  # idle connections go at once
        gate.set()
        resp = await busy.response()
        assert await busy.closed()
        await closing
    assert resp.body == b"done"
    assert resp.header("connection") == "close"
    assert router.balanced


async def test_client_leaving_mid_request_releases_the_backend(start: Start) -> None:
    async def slow(ex: Exchange) -> None:
        await asyncio.sleep(WAIT)

    web = await start("m-web", slow)
    router = FakeRouter({"web": [web.backend()]})
    async with edge(router) as e:
        client = await e.client()
        await client.send(build_request(f"web.{DOMAIN}"))
        await eventually(lambda: len(web.requests) == 1, "request in flight")
        client.writer.transport.abort()
        await eventually(lambda: router.balanced, "released after the client left")
    assert router.released[0].ok is False


async def test_body_waits_for_a_slow_router_then_flows(start: Start) -> None:
    web = await start("m-web")
    router = FakeRouter({"web": [web.backend()]})
    router.gate = asyncio.Event()  # a cold start in progress
    async with edge(router, Limits(buffer_bytes=1000)) as e:
        client = await e.client()
        body = b"z" * 200_000  # far more than is buffered: reading pauses meanwhile
        sending = asyncio.create_task(
            client.send(build_request(f"web.{DOMAIN}", method="POST", body=body))
        )
        await eventually(lambda: router.waiting == 1, "the request waits for a machine")
        router.gate.set()
        await sending
        resp = await client.response()
    assert resp.json()["body_len"] == len(body)
    assert router.balanced


async def test_client_leaving_during_a_cold_start_acquires_nothing(start: Start) -> None:
    web = await start("m-web")
    router = FakeRouter({"web": [web.backend()]})
    router.gate = asyncio.Event()
    async with edge(router) as e:
        client = await e.client()
        await client.send(build_request(f"web.{DOMAIN}"))
        await eventually(lambda: router.waiting == 1, "the request waits for a machine")
        client.writer.transport.abort()
        await eventually(lambda: router.waiting == 0, "the wait is abandoned")
    assert router.acquired == []
    assert router.released == []


async def test_clients_vanishing_at_any_moment_leave_nothing_acquired(start: Start) -> None:
    web = await start("m-web")
    router = FakeRouter({"web": [web.backend()]})
    async with edge(router) as e:
        for i in range(30):
            client = await e.client()
            await client.send(build_request(f"web.{DOMAIN}", f"/{i}"))
            if i % 3:
                await asyncio.sleep(0.001 * (i % 5))  # a little further along, some of the time
            client.writer.transport.abort()
        await eventually(lambda: e.proxy.connections == 0, "all gone")
        await eventually(lambda: router.balanced, "every acquire released")
        assert (await e.get("web")).status == 200  # and the proxy is fine


async def test_expect_100_continue(start: Start) -> None:
    async def continuing(ex: Exchange) -> None:
        ex.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await ex.read_body()
        ex.respond(200, body.upper())

    web = await start("m-web", continuing)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(
            build_request(
                f"web.{DOMAIN}",
                method="POST",
                headers=[("Expect", "100-continue"), ("Content-Length", "5")],
            )
        )
        interim = await client.response()
        await client.send(b"hello")
        final = await client.response()
        await client.close()
    assert interim.status == 100
    assert final.body == b"HELLO"


async def test_many_concurrent_clients(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:

        async def one(i: int) -> int:
            client = await RawClient.connect(e.port)
            try:
                for j in range(5):
                    resp = await client.request(f"web.{DOMAIN}", f"/{i}/{j}")
                    assert resp.json()["target"] == f"/{i}/{j}"
                return 5
            finally:
                await client.close()

        done = await asyncio.gather(*(one(i) for i in range(50)))
    assert sum(done) == 250
    assert web.connections <= 50


# -- machines lost with their worker --------------------------------------------------------------


async def test_requests_in_flight_to_a_lost_machine_end_at_once(start: Start) -> None:
    never = asyncio.Event()

    async def hang(ex: Exchange) -> None:
        if ex.seen.target != "/hang":
            await echo(ex)
            return
        await ex.read_body()
        async with asyncio.timeout(WAIT * 2):  # outlasts every client wait: no answer comes
            await never.wait()

    async def cut_short(ex: Exchange) -> None:
        ex.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await hang(ex)

    lost = await start("m-lost", hang)
    half = await start("m-half", cut_short)
    ok = await start("m-ok")
    router = FakeRouter({"web": [lost.backend()], "half": [half.backend("half")]})
    # No timeout of the proxy's own ends these: only the lost-machines hook can.
    async with edge(router, Limits(upstream_response_timeout=600, read_timeout=600)) as e:
        assert (await e.get("web")).status == 200  # leaves an idle pooled connection
        assert e.proxy.idle_upstream_connections == 1
        get, post, streaming = await e.client(), await e.client(), await e.client()
        await get.send(build_request(f"web.{DOMAIN}", "/hang"))
        await post.send(build_request(f"web.{DOMAIN}", "/hang", "POST", body=b"once"))
        await streaming.send(build_request(f"half.{DOMAIN}", "/hang"))
        await eventually(
            lambda: len(lost.requests) == 3 and len(half.requests) == 1, "requests in flight"
        )

        # The worker of m-lost and m-half is declared dead: the router routes "web" elsewhere.
        router.apps["web"] = [ok.backend()]
        ended = e.proxy.machines_lost(frozenset({"m-lost", "m-half"}), "worker-1 is dead")
        assert ended == 3
        assert e.proxy.idle_upstream_connections == 0

        moved = await get.response()  # a GET without an answer yet goes elsewhere
        assert (moved.status, moved.header("nonomad-machine-id")) == (200, "m-ok")
        assert moved.json()["target"] == "/hang"
        refused = await post.response()  # a POST may have had effects: not sent again
        assert refused.status == 502
        assert "m-lost was lost" in refused.text
        assert await streaming.closed()  # the response was cut short: so is the connection
    assert [r.method for r in ok.requests] == ["GET"]
    assert router.balanced
    assert sorted(r.ok for r in router.released if r.machine_id == "m-lost") == [False, False, True]
