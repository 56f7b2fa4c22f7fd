"""HTTP/1.1 as both sides of the data plane write it: status lines, framing bytes, the header
names the proxy handles itself (reads, drops or replaces) instead of passing them on, and the
plain-text error responses it answers with."""

from __future__ import annotations

from http import HTTPStatus
from typing import Final


def _status_line(code: int) -> bytes:
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {code} {phrase}\r\n".encode("latin-1")


STATUS_LINES: Final = {code: _status_line(code) for code in range(100, 600)}
CRLF: Final = b"\r\n"
CHUNK_END: Final = b"0\r\n\r\n"
_HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
FRAMING: Final = frozenset({b"content-length", b"transfer-encoding", b"host"})
"""Headers the edge frames or routes a request by. A Connection header naming one is refused
(RFC 9110 7.6.1 has a proxy drop what Connection names: dropping one of these would let what
the machine reads differ from what the edge read, the root of request smuggling)."""
FORWARDED: Final = frozenset(
    {
        # what the edge writes itself (proxy.forwarded)
        b"forwarded",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-real-ip",
        # what frameworks and other proxies read for the client's address, scheme, host or
        # port: Rack (Client-IP, X-Forwarded-Ssl, X-Forwarded-Scheme), Werkzeug's ProxyFix
        # (X-Forwarded-Port, -Prefix), IIS, CDNs, Envoy, Fly's edge
        b"x-forwarded-port",
        b"x-forwarded-prefix",
        b"x-forwarded-server",
        b"x-forwarded-scheme",
        b"x-forwarded-ssl",
        b"x-forwarded-protocol",
        b"x-forwarded-client-cert",
        b"x-original-forwarded-for",
        b"front-end-https",
        b"x-url-scheme",
        b"x-scheme",
        b"client-ip",
        b"x-client-ip",
        b"x-cluster-client-ip",
        b"x-originating-ip",
        b"true-client-ip",
        b"cf-connecting-ip",
        b"fastly-client-ip",
        b"fly-client-ip",
        b"fly-forwarded-port",
        b"fly-forwarded-proto",
        b"fly-forwarded-ssl",
        b"x-envoy-external-address",
    }
)
"""Request headers that say who the client is, or what scheme, host or port it used. A
machine may trust them, so from a client they never pass: the edge writes its own from the
connection it accepted (proxy.forwarded). From a hop the operator trusts, those it does not
write pass on as the hop sent them."""
# Request headers the proxy reads or replaces (besides hop-by-hop ones).
REQ_SPECIAL: Final = _HOP_BY_HOP | FORWARDED | {b"host", b"content-length"}
# With tracing on, the incoming trace context is read and replaced by the proxy's own.
_TRACE_HEADERS: Final = frozenset({b"traceparent", b"tracestate"})
REQ_SPECIAL_TRACED: Final = REQ_SPECIAL | _TRACE_HEADERS
RESP_SPECIAL: Final = _HOP_BY_HOP | {b"content-length"}
_TCHAR: Final = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def is_token(value: bytes) -> bool:
    """Whether `value` is an RFC 9110 token (a header name, a connection option)."""
    return bool(value) and not value.translate(None, _TCHAR)


def connection_options(value: bytes) -> list[bytes]:
    """The options of a Connection header (lowercased, empty list elements skipped).
    Raises ValueError for one that is not a token."""
    options = []
    for option in value.split(b","):
        option = option.strip(b" \t").lower()
        if not option:
            continue
        if not is_token(option):
            raise ValueError(option)
        options.append(option)
    return options


def drop_headers(parts: list[bytes], names: list[bytes], start: int) -> list[bytes]:
    """A head's parts (`start` of them for its first line, then four per header: name, ": ",
    value, CRLF) without the headers whose lowercased names are in `names` (those a Connection
    header names)."""
    drop = set(names)
    out = parts[:start]
    for i in range(start, len(parts), 4):
        if parts[i].lower() not in drop:
            out += parts[i : i + 4]
    return out


def error_response(
    status: int, reason: str, *, keep_alive: bool, head_only: bool = False, http10: bool = False
) -> bytes:
    """A plain-text error response whose body says why."""
    body = f"{status} {_phrase(status)}: {reason}\n".encode()
    conn = (b"keep-alive" if http10 else b"") if keep_alive else b"close"
    return b"".join(
        (
            STATUS_LINES.get(status, b"HTTP/1.1 %d Error\r\n" % status),
            b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body),
            b"connection: " + conn + CRLF if conn else b"",
            CRLF,
            b"" if head_only else body,
        )
    )


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


OVERLOADED: Final = error_response(503, "too many connections", keep_alive=False)
