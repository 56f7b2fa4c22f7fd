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
# Request headers the proxy reads or replaces (besides hop-by-hop ones).
REQ_SPECIAL: Final = _HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"x-forwarded-for",
    b"x-forwarded-proto",
    b"x-forwarded-host",
}
# With tracing on, the incoming trace context is read and replaced by the proxy's own.
_TRACE_HEADERS: Final = frozenset({b"traceparent", b"tracestate"})
REQ_SPECIAL_TRACED: Final = REQ_SPECIAL | _TRACE_HEADERS
RESP_SPECIAL: Final = _HOP_BY_HOP | {b"content-length"}


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
