"""Proxy benchmark: the HTTP parser choice (part 1 of bench.proxy_bench).

A micro-benchmark of the candidate HTTP/1.1 parsers (httptools, i.e. llhttp, and h11) on a
typical browser request and a typical 1 KiB JSON response: µs per message, best of 3. The
proxy uses the faster one that parses incrementally and handles chunked bodies and Upgrade.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.report import Results

REQUEST = (
    b"GET /api/v1/items?page=2&sort=desc HTTP/1.1\r\n"
    b"Host: myapp.nonomad.test\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 Chrome/126.0 Safari/537.36\r\n"
    b"Accept: text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8\r\n"
    b"Accept-Language: en-US,en;q=0.9\r\n"
    b"Accept-Encoding: gzip, deflate, br\r\n"
    b"Cookie: session=0123456789abcdef0123456789abcdef; theme=dark\r\n"
    b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
    b"Connection: keep-alive\r\n\r\n"
)


RESPONSE = (
    b"HTTP/1.1 200 OK\r\n"
    b"Date: Mon, 02 Nov 2026 10:00:00 GMT\r\n"
    b"Server: app\r\n"
    b"Content-Type: application/json\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Content-Length: 1024\r\n"
    b"Connection: keep-alive\r\n\r\n" + b"x" * 1024
)


class _Sink:
    """Parser callbacks that keep what a proxy keeps: the headers and the body pieces."""

    __slots__ = ("body", "done", "headers")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True


def _time_httptools(kind: str, n: int) -> float:
    import httptools

    sink = _Sink()
    parser: Any
    if kind == "request":
        parser, data = httptools.HttpRequestParser(sink), REQUEST
    else:
        parser, data = httptools.HttpResponseParser(sink), RESPONSE
    start = time.perf_counter()
    for _ in range(n):
        sink.headers = []
        sink.body = []
        parser.feed_data(data)
    return (time.perf_counter() - start) / n


def _time_h11(kind: str, n: int) -> float:
    import h11

    # h11 parses one cycle per Connection; the connections are made outside the timing.
    conns = []
    for _ in range(n):
        if kind == "request":
            conn = h11.Connection(h11.SERVER)
        else:
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="GET", target="/", headers=[("Host", "a")]))
            conn.send(h11.EndOfMessage())
        conns.append(conn)
    data = REQUEST if kind == "request" else RESPONSE
    start = time.perf_counter()
    for conn in conns:
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if type(event) is h11.EndOfMessage or event is h11.NEED_DATA:
                break
    return (time.perf_counter() - start) / n


PARSERS: dict[str, Callable[[str, int], float]] = {
    "httptools (llhttp)": _time_httptools,
    "h11": _time_h11,
}


def parser_bench(quick: bool = False) -> Results:
    """µs per message for each candidate parser (best of 3 runs), as a table."""
    results = Results("HTTP/1.1 parsers: time to parse one message (best of 3)")
    n = 3_000 if quick else 30_000
    for name, timer in PARSERS.items():
        for kind in ("request", "response"):
            try:
                best = min(timer(kind, n) for _ in range(3))
            except ImportError:
                results.add(f"{name}, {kind}", None, "µs", note="not installed")
                continue
            results.add(f"{name}, {kind}", best * 1e6, "µs")
    return results
