"""Checks of request fields every service shares: names, signals, durations.

Each failure raises `runtime.errors.InvalidArgument` naming the field. Error texts quote at
most a short prefix of the offending value (`quote`): a megabyte of name must not come back
as a megabyte of error text, which would overflow the caller's metadata limit.
"""

from __future__ import annotations

import re
import signal as signals

from google.protobuf.duration_pb2 import Duration

from runtime.errors import InvalidArgument

NAME_PATTERN = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
NAME_RE = re.compile(NAME_PATTERN)
"""An id or name: 1-63 lowercase letters, digits or dashes, not starting or ending with a
dash. Match it with `is_name` (a full match): `re.match` with `$` lets a trailing newline in."""
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BOOT_ID_RE = re.compile(r"[A-Za-z0-9._-]{0,64}")
"""A worker's boot id: at most 64 letters, digits, dots, underscores or dashes."""
QUOTE_LIMIT = 40


def quote(value: str, limit: int = QUOTE_LIMIT) -> str:
    """`value` quoted for an error text, cut to `limit` characters with its full length named."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} chars)"


def is_name(value: str) -> bool:
    """True when the whole of `value` is a valid name (no trailing newline, no prefix match)."""
    return NAME_RE.fullmatch(value) is not None


def is_env_key(value: str) -> bool:
    return ENV_KEY_RE.fullmatch(value) is not None


def is_boot_id(value: str) -> bool:
    """True when the whole of `value` is a valid boot id (empty included)."""
    return BOOT_ID_RE.fullmatch(value) is not None


def parse_host_port(value: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 hosts in brackets: `[::1]:50051`) into host and port.

    Raises ValueError when the value does not parse or the port is outside 0..65535.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected host:port, got {quote(value)}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"IPv6 addresses need brackets, as in [::1]:50051, got {quote(value)}")
    if not host:
        raise ValueError(f"expected host:port, got {quote(value)}")
    if not port_text.isdigit():
        raise ValueError(f"port must be a number, got {quote(port_text)}")
    # (A digit string of any length would be parsed, and echoed, in full.)
    port = int(port_text) if len(port_text) <= 5 else -1
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {quote(port_text)}")
    return host, port


def check_name(field: str, value: str, *, required: bool = True) -> None:
    if not value:
        if required:
            raise InvalidArgument(field, "is required")
        return
    if not is_name(value):
        raise InvalidArgument(
            field,
            f"{quote(value)} must be 1-63 lowercase letters, digits or dashes, "
            "starting and ending with a letter or digit",
        )


def parse_signal(field: str, name: str, default: int = int(signals.SIGTERM)) -> int:
    """A signal name ("SIGTERM", "TERM") or number as a signal number."""
    if not name:
        return default
    text = name.strip().upper()
    if text.isdigit():
        number = int(text)
        if number in {int(s) for s in signals.Signals}:
            return number
    else:
        full = text if text.startswith("SIG") else "SIG" + text
        if full in signals.Signals.__members__:
            return int(signals.Signals[full])
    raise InvalidArgument(field, f"unknown signal {quote(name)}")


def duration_seconds(
    field: str, value: Duration, *, default: float, maximum: float, present: bool
) -> float:
    """A Duration field in seconds: `default` when absent, never negative nor over `maximum`."""
    if not present:
        return default
    seconds = value.seconds + value.nanos / 1e9
    if seconds < 0:
        raise InvalidArgument(field, "must not be negative")
    if seconds > maximum:
        raise InvalidArgument(field, f"must be at most {maximum:g}s")
    return seconds
