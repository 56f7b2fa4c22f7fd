"""The edge against hostile clients (issue 19): absolute-form targets and Host ports (defect 7),
and one client holding more idle connections than the proxy's cap (defect 8)."""

from __future__ import annotations

import asyncio
from ipaddress import ip_network

import pytest

from proxy.forwarded import Forwarding
from proxy.limits import Limits
from proxy.wire import FORWARDED
from tests.proxy.http_support import (
    DOMAIN,
    WAIT,
    Exchange,
    FakeRouter,
    Handler,
    SeenRequest,
    Start,
    backend_for,
    build_request,
    dead_port,
    edge,
    eventually,
    gated,
)

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


# -- request smuggling (issue 27, attack 5) ----------------------------------------------------

SMUGGLED = (
    f"GET /smuggled HTTP/1.1\r\nHost: web.{DOMAIN}\r\nX-Forwarded-For: 203.0.113.66\r\n\r\n"
).encode()


@pytest.mark.usefixtures("router_path")
async def test_the_attack_connection_naming_content_length_is_refused(start: Start) -> None:
    """The attack of the issue: a POST whose Connection header names Content-Length, with a
    body that is a whole request. Dropping the length as hop-by-hop left the machine a POST
    without a body, and the body its next request, with a forged client address."""
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        assert (await e.get("web", "/before")).status == 200
        client = await e.client()
        await client.send(
            build_request(
                f"web.{DOMAIN}",
                method="POST",
                headers=[("Connection", "content-length")],
                body=SMUGGLED,
            )
        )
        resp = await client.response()
        assert resp.status == 400
        assert "Connection names content-length" in resp.text
        assert await client.closed()
        # The machine is still fine for everyone else, and sees the edge's address only.
        assert (await e.get("web", "/after")).status == 200
    assert [r.target for r in web.requests] == ["/before", "/after"]
    assert [r.header("x-forwarded-for") for r in web.requests] == ["127.0.0.1"] * 2


@pytest.mark.usefixtures("router_path")
async def test_a_request_inside_a_body_stays_a_body(start: Start) -> None:
    """The same body without the Connection trick: the machine sees exactly one request, the
    POST, with the edge's framing and X-Forwarded-For; the next request on the same machine
    connection is the client's next one."""
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        posted = await client.request(f"web.{DOMAIN}", method="POST", body=SMUGGLED)
        after = await client.request(f"web.{DOMAIN}", "/after")
    assert posted.status == after.status == 200
    assert posted.json()["body"] == SMUGGLED.decode()
    assert [r.target for r in web.requests] == ["/", "/after"]
    first = web.requests[0]
    assert first.header("content-length") == str(len(SMUGGLED))
    assert first.header("x-forwarded-for") == "127.0.0.1"
    assert web.connections == 1


@pytest.mark.parametrize(
    ("head", "body", "status", "reason"),
    [
        # Connection naming what the edge frames or routes by
        ("Connection: content-length\r\nContent-Length: 3", b"abc", 400, "content-length"),
        ("Connection: keep-alive, Content-Length\r\nContent-Length: 3", b"abc", 400, "content-"),
        (
            "Connection: transfer-encoding\r\nTransfer-Encoding: chunked",
            b"3\r\nabc\r\n0\r\n\r\n",
            400,
            "transfer-encoding",
        ),
        ("Connection: host", b"", 400, "Connection names host"),
        ("Connection: a b", b"", 400, "malformed Connection"),
        # lengths
        ("Content-Length: 3\r\nContent-Length: 3", b"abc", 400, "Duplicate Content-Length"),
        ("Content-Length: 3\r\nContent-Length: 4", b"abcd", 400, "Duplicate Content-Length"),
        ("Content-Length: 3, 3", b"abc", 400, "Content-Length"),
        ("Content-Length: +3", b"abc", 400, "Content-Length"),
        ("Content-Length: 99999999999999999999999", b"", 400, "overflow"),
        # Content-Length and Transfer-Encoding, either order
        ("Content-Length: 3\r\nTransfer-Encoding: chunked", b"3\r\nabc\r\n0\r\n\r\n", 400, "Tr"),
        ("Transfer-Encoding: chunked\r\nContent-Length: 3", b"3\r\nabc\r\n0\r\n\r\n", 400, "Co"),
        # a coding other than chunked last, or one the edge would drop
        ("Transfer-Encoding: gzip", b"abc", 400, "Transfer-Encoding"),
        ("Transfer-Encoding: chunked, gzip", b"abc", 400, "Transfer-Encoding"),
        ("Transfer-Encoding: identity", b"abc", 400, "Transfer-Encoding"),
        ("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked", b"0\r\n\r\n", 400, "Trans"),
        ("Transfer-Encoding: gzip, chunked", b"3\r\nabc\r\n0\r\n\r\n", 501, "'gzip'"),
        (
            "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked",
            b"3\r\nabc\r\n0\r\n\r\n",
            501,
            "'gzip'",
        ),
        # obs-fold, bare CR or LF, whitespace before the colon, control characters
        ("X-A: a\r\n b\r\nContent-Length: 0", b"", 400, "whitespace"),
        ("Content-Length: 0\r\n 3", b"abc", 400, "whitespace"),
        ("X-A: a\nContent-Length: 0", b"", 400, "CR"),
        ("X-A: a\rContent-Length: 3", b"abc", 400, "LF"),
        ("Content-Length : 3", b"abc", 400, "header"),
        ("X-A\t: 3", b"", 400, "header token"),
        ("X-A: a\x00b", b"", 400, "header value char"),
        ("X-A: a\x7fb", b"", 400, "header value char"),
        # chunk sizes
        ("Transfer-Encoding: chunked", b"zz\r\nabc\r\n0\r\n\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked", b"-3\r\nabc\r\n0\r\n\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked", b"0x3\r\nabc\r\n0\r\n\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked", b" 3\r\nabc\r\n0\r\n\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked", b"3 \r\nabc\r\n0\r\n\r\n", 400, "chunk size"),
        ("Transfer-Encoding: chunked", b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", 400, "chunk"),
        ("Transfer-Encoding: chunked", b"fffffffffffffffff\r\nabc\r\n", 400, "overflow"),
        ("Transfer-Encoding: chunked", b"3\nabc\n0\n\n", 400, "CR"),
        ("Transfer-Encoding: chunked", b"3\r\nabcXX0\r\n\r\n", 400, "chunk data"),
        ("Transfer-Encoding: chunked", b"3\r\nabc\r\n0\r\nContent-Length: 5\r\n\r\n", 400, "Con"),
        # upgrades carry no body
        ("Connection: upgrade\r\nUpgrade: websocket\r\nContent-Length: 3", b"abc", 400, "upgr"),
    ],
    ids=[
        "conn-content-length",
        "conn-list-content-length",
        "conn-transfer-encoding",
        "conn-host",
        "conn-not-a-token",
        "cl-twice-same",
        "cl-twice-different",
        "cl-list",
        "cl-sign",
        "cl-overflow",
        "cl-then-te",
        "te-then-cl",
        "te-gzip",
        "te-chunked-not-last",
        "te-identity",
        "te-chunked-twice",
        "te-gzip-chunked",
        "te-gzip-then-chunked",
        "obs-fold",
        "obs-fold-length",
        "bare-lf",
        "bare-cr",
        "space-before-colon",
        "tab-before-colon",
        "nul",
        "del",
        "chunk-not-hex",
        "chunk-negative",
        "chunk-0x",
        "chunk-leading-space",
        "chunk-trailing-space",
        "chunk-underscore",
        "chunk-overflow",
        "chunk-bare-lf",
        "chunk-no-crlf-after-data",
        "trailer-content-length",
        "upgrade-with-body",
    ],
)
@pytest.mark.usefixtures("router_path")
async def test_broken_framing_is_refused_and_reaches_no_machine(
    start: Start, head: str, body: bytes, status: int, reason: str
) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        # An idle pooled connection: with the fast path, a request could go out at once.
        assert (await e.get("web", "/warm")).status == 200
        client = await e.client()
        await client.send(
            f"POST / HTTP/1.1\r\nHost: web.{DOMAIN}\r\n{head}\r\n\r\n".encode() + body + SMUGGLED
        )
        resp = await client.response()
        assert (resp.status, reason in resp.text) == (status, True), resp.text
        assert await client.closed()
        assert (await e.get("web", "/after")).status == 200
    assert resp.header("connection") == "close"
    assert [r.target for r in web.requests] == ["/warm", "/after"]
    assert web.connections == 1  # the pooled connection was never written to out of turn


@pytest.mark.parametrize(
    ("raw", "status", "reason"),
    [
        (f"GET / HTTP/2.0\r\nHost: web.{DOMAIN}\r\n\r\n", 505, "HTTP/2.0"),
        ("GET /\r\n\r\n", 505, "HTTP/0.9"),
        (f"GET / HTTP/1.2\r\nHost: web.{DOMAIN}\r\n\r\n", 400, "version"),
        (
            f"POST / HTTP/1.0\r\nHost: web.{DOMAIN}\r\nTransfer-Encoding: chunked\r\n\r\n"
            "3\r\nabc\r\n0\r\n\r\n",
            400,
            "HTTP/1.0",
        ),
    ],
    ids=["http-2.0", "http-0.9", "http-1.2", "http-1.0-chunked"],
)
@pytest.mark.usefixtures("router_path")
async def test_versions_other_than_1_1_and_1_0_are_refused(
    start: Start, raw: str, status: int, reason: str
) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(raw.encode())
        resp = await client.response()
        assert await client.closed()
    assert (resp.status, reason in resp.text) == (status, True)
    assert web.requests == []


@pytest.mark.usefixtures("router_path")
async def test_the_edge_writes_the_framing_the_machine_reads(start: Start) -> None:
    """What a machine gets is framed by the edge: one Content-Length it wrote (leading zeros
    gone) or a chunked body it chunked itself (extensions and trailers gone), never the
    client's lines, and never both."""
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(
            f"PUT /cl HTTP/1.1\r\nHost: web.{DOMAIN}\r\nContent-Length: 003\r\n\r\nabc".encode()
            + f"PUT /te HTTP/1.1\r\nHost: web.{DOMAIN}\r\nTransfer-Encoding: chunked\r\n"
            "\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n".encode()
        )
        cl, te = await client.response(), await client.response()
    assert (cl.json()["body"], te.json()["body"]) == ("abc", "abcde")
    first, second = web.requests
    assert first.header("content-length") == "3"
    assert first.header("transfer-encoding") is None
    assert second.header("transfer-encoding") == "chunked"
    assert second.header("content-length") is None
    assert second.header("x-trailer") is None


@pytest.mark.usefixtures("router_path")
async def test_nothing_pipelined_after_a_request_that_ends_the_connection_is_read(
    start: Start,
) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        assert (await e.get("web", "/warm")).status == 200
        client = await e.client()
        await client.send(
            f"GET / HTTP/1.1\r\nHost: web.{DOMAIN}\r\nHost: web.{DOMAIN}\r\n\r\n".encode()
            + SMUGGLED
        )
        resp = await client.response()
        assert await client.closed()
    assert (resp.status, "more than one Host" in resp.text) == (400, True)
    assert [r.target for r in web.requests] == ["/warm"]


# -- forwarding headers --------------------------------------------------------------------------

SPOOFED = [
    ("X-Forwarded-For", "203.0.113.66"),
    ("Forwarded", "for=203.0.113.66;proto=https"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Host", "bank.example"),
    ("X-Real-IP", "203.0.113.66"),
    ("X-Client-IP", "203.0.113.66"),
    ("True-Client-IP", "203.0.113.66"),
    ("Fly-Client-IP", "203.0.113.66"),
    ("X-Forwarded-Ssl", "on"),
]


def _forwarding(seen: SeenRequest) -> dict[str, str | None]:
    names = {name.lower() for name, _ in SPOOFED}
    return {name: seen.header(name) for name in sorted(names)}


@pytest.mark.parametrize("name", sorted(FORWARDED))
async def test_a_clients_forwarding_header_never_reaches_a_machine(
    start: Start, name: bytes
) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), trusted_proxies=["127.0.0.2/32"]) as e:
        resp = await e.get("web", headers=[(name.decode(), "203.0.113.66")])
    assert resp.status == 200
    seen = web.requests[0]
    assert all("203.0.113.66" not in value for _, value in seen.headers), seen.headers


async def test_the_edge_writes_who_the_client_is(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), trusted_proxies=["127.0.0.2/32"]) as e:
        client = await e.client("127.0.0.3")  # a client, not the trusted hop
        await client.request(f"web.{DOMAIN}:8080", headers=SPOOFED)
    assert _forwarding(web.requests[0]) == {
        "fly-client-ip": None,
        "forwarded": f'for=127.0.0.3;proto=http;host="web.{DOMAIN}:8080"',
        "true-client-ip": None,
        "x-client-ip": None,
        "x-forwarded-for": "127.0.0.3",
        "x-forwarded-host": f"web.{DOMAIN}:8080",
        "x-forwarded-proto": "http",
        "x-forwarded-ssl": None,
        "x-real-ip": "127.0.0.3",
    }


async def test_a_trusted_hop_has_its_chain_appended_to(start: Start) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), trusted_proxies=["127.0.0.2/32"]) as e:
        hop = await e.client("127.0.0.2")
        await hop.request(
            f"web.{DOMAIN}",
            headers=[
                ("X-Forwarded-For", "198.51.100.7"),
                ("Forwarded", "for=198.51.100.7;proto=https"),
                ("X-Forwarded-Proto", "https"),
                ("X-Forwarded-Host", "www.example.com"),
                ("X-Real-IP", "192.0.2.1"),  # the edge names the client itself
                ("X-Client-IP", "198.51.100.7"),  # not one the edge writes: passed on
            ],
        )
    assert _forwarding(web.requests[0]) == {
        "fly-client-ip": None,
        "forwarded": f'for=198.51.100.7;proto=https, for=127.0.0.2;proto=http;host="web.{DOMAIN}"',
        "true-client-ip": None,
        "x-client-ip": "198.51.100.7",
        "x-forwarded-for": "198.51.100.7, 127.0.0.2",
        "x-forwarded-host": "www.example.com",
        "x-forwarded-proto": "https",
        "x-forwarded-ssl": None,
        "x-real-ip": "198.51.100.7",
    }


@pytest.mark.parametrize(
    ("chain", "real"),
    [
        ("203.0.113.5", "203.0.113.5"),
        ("203.0.113.5, 10.1.2.3", "203.0.113.5"),  # through another trusted hop
        ("6.6.6.6, 203.0.113.5", "203.0.113.5"),  # what the client wrote itself is not it
        ("10.9.9.9, 10.1.2.3", "10.9.9.9"),  # all trusted: the first
        ("unknown, 10.1.2.3", "unknown"),  # not an address: not trusted
    ],
)
async def test_behind_trusted_hops_the_real_ip_is_the_nearest_untrusted(
    start: Start, chain: str, real: str
) -> None:
    web = await start("m-web")
    trusted = ["127.0.0.2/32", "10.0.0.0/8"]
    async with edge(FakeRouter({"web": [web.backend()]}), trusted_proxies=trusted) as e:
        hop = await e.client("127.0.0.2")
        # The chain in two lines: one list, in order.
        first, _, rest = chain.partition(", ")
        lines = [("X-Forwarded-For", first)] + ([("X-Forwarded-For", rest)] if rest else [])
        await hop.request(f"web.{DOMAIN}", headers=lines)
    seen = web.requests[0]
    assert seen.header("x-forwarded-for") == f"{chain}, 127.0.0.2"
    assert seen.header("x-real-ip") == real


async def test_a_trusted_hops_forwarding_header_its_connection_names_is_dropped(
    start: Start,
) -> None:
    web = await start("m-web")
    async with edge(FakeRouter({"web": [web.backend()]}), trusted_proxies=["127.0.0.2/32"]) as e:
        hop = await e.client("127.0.0.2")
        await hop.request(
            f"web.{DOMAIN}",
            headers=[
                ("X-Forwarded-For", "198.51.100.7"),
                ("X-Client-IP", "198.51.100.7"),
                ("Connection", "X-Forwarded-For, X-Client-IP"),
            ],
        )
    seen = web.requests[0]
    assert seen.header("x-forwarded-for") == seen.header("x-real-ip") == "127.0.0.2"
    assert seen.header("x-client-ip") is None


@pytest.mark.parametrize(
    ("trusted", "address", "yes"),
    [
        ([], "127.0.0.1", False),
        (["10.0.0.0/8"], "10.1.2.3", True),
        (["10.0.0.0/8"], "11.1.2.3", False),
        (["10.0.0.0/8"], "::ffff:10.1.2.3", True),  # an IPv4 client of a dual-stack listener
        (["2001:db8::/32"], "2001:db8::1", True),
        (["2001:db8::/32"], "10.1.2.3", False),
        (["10.0.0.0/8"], "not an address", False),
    ],
)
def test_which_addresses_are_trusted(trusted: list[str], address: str, yes: bool) -> None:
    assert Forwarding([ip_network(n) for n in trusted]).trusts(address) is yes


def test_an_ipv6_client_is_a_quoted_node_in_forwarded() -> None:
    assert b'Forwarded: for="[2001:db8::1]";proto=http;host="' in Forwarding.lines(b"2001:db8::1")


# -- hostile machines ---------------------------------------------------------------------------


def _raw(response: bytes) -> Handler:
    """A machine that answers every request with these bytes."""

    async def handler(ex: Exchange) -> bool | None:
        await ex.read_body()
        if ex.seen.target == "/next":
            ex.respond(200, b"the real answer")
        else:
            ex.writer.write(response)
        return None

    return handler


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde",
        b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
        b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: a b\r\nContent-Length: 0\r\n\r\n",
    ],
    ids=[
        "cl-then-te",
        "te-then-cl",
        "cl-twice",
        "cl-negative",
        "te-gzip",
        "te-gzip-chunked",
        "obs-fold",
        "bare-lf",
        "two-digit-status",
        "connection-not-a-token",
    ],
)
@pytest.mark.usefixtures("router_path")
async def test_a_response_with_broken_framing_is_a_502_and_its_connection_ends(
    start: Start, response: bytes
) -> None:
    web = await start("m-web", _raw(response))
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        resp = await client.request(f"web.{DOMAIN}")
        again = await client.request(f"web.{DOMAIN}", "/next")  # the client's connection is fine
    assert resp.status == 502
    assert "invalid response" in resp.text
    assert (again.status, again.body) == (200, b"the real answer")
    assert web.connections == 2  # the broken connection was not used again


@pytest.mark.usefixtures("router_path")
async def test_bytes_beyond_a_response_are_never_anyone_elses_answer(start: Start) -> None:
    """A machine answers with more than the length it gave (here the head of a second
    response, whose body would be the first bytes of its next answer): the client gets exactly
    the length, and the next request, the machine's real answer on a new connection."""
    extra = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n"
    web = await start("m-web", _raw(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc" + extra))
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        first = await client.request(f"web.{DOMAIN}")
        other = await e.client()
        second = await other.request(f"web.{DOMAIN}", "/next", "POST", body=b"once")
    assert (first.status, first.body, first.header("content-length")) == (200, b"abc", "3")
    assert (second.status, second.body) == (200, b"the real answer")
    assert web.connections == 2


@pytest.mark.usefixtures("router_path")
async def test_the_edge_writes_the_framing_the_client_reads(start: Start) -> None:
    """A response's Content-Length is the edge's (leading zeros gone, and kept when the
    machine's Connection names it); the headers Connection names are dropped."""
    web = await start(
        "m-web",
        _raw(
            b"HTTP/1.1 200 OK\r\nConnection: content-length, x-hop\r\nX-Hop: 1\r\n"
            b"X-App: 2\r\nContent-Length: 003\r\n\r\nabc"
        ),
    )
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        resp = await client.request(f"web.{DOMAIN}")
        again = await client.request(f"web.{DOMAIN}")
    assert (resp.body, again.body) == (b"abc", b"abc")
    assert resp.header("content-length") == "3"
    assert (resp.header("x-hop"), resp.header("x-app"), resp.header("connection")) == (
        None,
        "2",
        None,
    )
    assert web.connections == 1


@pytest.mark.usefixtures("router_path")
async def test_a_machine_that_answers_before_the_body_is_sent_is_not_reused(start: Start) -> None:
    """The machine answers a POST before its body is all sent: the rest of the body never
    reaches it, so its connection is closed, not pooled (it would read the next request as
    that body)."""

    async def early(ex: Exchange) -> bool:
        if ex.seen.target == "/":
            ex.respond(200, b"early")  # and then reads the rest of the body, to go on
        else:
            ex.respond(200, b"fine")
        return True

    web = await start("m-web", early)
    async with edge(FakeRouter({"web": [web.backend()]})) as e:
        client = await e.client()
        await client.send(
            build_request(f"web.{DOMAIN}", "/", "POST", headers=[("Content-Length", "10")])
            + b"12345"
        )
        resp = await client.response()
        assert await client.closed()  # the rest of its body had nowhere to go
        after = await e.get("web", "/next", method="POST", body=b"once")
    assert (resp.body, after.body) == (b"early", b"fine")
    assert [r.target for r in web.requests] == ["/", "/next"]
    assert web.connections == 2


# -- connections to one machine ---------------------------------------------------------------


async def test_a_flood_opens_no_more_connections_to_a_machine_than_its_cap(start: Start) -> None:
    gate = asyncio.Event()

    web = await start("m-web", gated(gate, b"ok"))
    limits = Limits(max_connections_per_machine=3, upstream_connect_timeout=WAIT)
    async with edge(FakeRouter({"web": [web.backend()]}), limits) as e:
        clients = [await e.client() for _ in range(12)]
        for client in clients:
            await client.send(build_request(f"web.{DOMAIN}"))
        await eventually(lambda: len(web.requests) == 3, "three requests at the machine")
        assert e.proxy.upstream_connections("m-web") == 3
        gate.set()
        answers = [await client.response() for client in clients]
        assert e.proxy.upstream_connections("m-web") <= 3
    assert [a.status for a in answers] == [200] * 12
    assert web.most_open == 3
    assert len(web.requests) == 12
    assert e.router.balanced


async def test_at_the_cap_a_request_waits_then_is_refused(start: Start) -> None:
    gate = asyncio.Event()

    web = await start("m-web", gated(gate, b"ok"))
    limits = Limits(max_connections_per_machine=1, upstream_connect_timeout=0.2)
    async with edge(FakeRouter({"web": [web.backend()]}), limits) as e:
        busy = await e.client()
        await busy.send(build_request(f"web.{DOMAIN}"))
        await eventually(lambda: len(web.requests) == 1, "the one connection busy")
        refused = await e.get("web")
        leaving = await e.client()  # waits for the connection, then goes away
        await leaving.send(build_request(f"web.{DOMAIN}"))
        await asyncio.sleep(0)
        leaving.writer.transport.abort()
        gate.set()
        assert (await busy.response()).status == 200
        assert (await e.get("web")).status == 200  # the pooled connection again
        await eventually(lambda: e.router.balanced, "every acquire released")
    assert refused.status == 503
    assert "has 1 connections open, the most the edge opens to one machine" in refused.text
    assert web.connections == web.most_open == 1


async def test_connections_that_fail_leave_the_count(start: Start) -> None:
    router = FakeRouter({"web": [backend_for("m-dead", dead_port())]})
    async with edge(router, Limits(max_connections_per_machine=1, max_retries=0)) as e:
        for _ in range(3):
            assert (await e.get("web", method="POST", body=b"x")).status == 502
        assert e.proxy.upstream_connections("m-dead") == 0
