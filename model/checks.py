"""A machine's checks, resolved to host ports, and the probes that run them.

The ground both checkers stand on: flyd's readiness (flyd.readiness: is a started machine
serving, and why not) and the proxy's health checks (proxy.control: may it get traffic). A
probe answers None when it passed, else what went wrong in words a user can act on.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from flyd.v1 import machine_pb2 as pb

# A check without an interval or timeout of its own.
DEFAULT_CHECK_INTERVAL = 10.0
DEFAULT_CHECK_TIMEOUT = 2.0
# Response head bytes an HTTP check reads at most.
CHECK_HEAD_LIMIT = 8192


@dataclass(frozen=True)
class CheckSpec:
    """One check of one machine, resolved to the host port it runs against."""

    name: str
    kind: str  # "http" or "tcp"
    host: str
    port: int
    path: str
    method: str
    interval: float
    timeout: float
    internal_port: int = 0
    """The machine's own port the check is on (what a user configured; `port` is the host's)."""


def seconds(d: object, default: float) -> float:
    """A Duration in seconds; `default` when it is unset or not positive."""
    value = getattr(d, "seconds", 0) + getattr(d, "nanos", 0) / 1e9
    return value if value > 0 else default


def checks_of(machine: pb.Machine, host: str) -> list[CheckSpec]:
    """The machine's configured checks against its host ports (a check on an unmapped port
    is kept with port 0: it fails, so the machine counts as unchecked rather than healthy)."""
    ports = {p.internal_port: p.host_port for p in machine.ports}
    services = machine.config.services
    first = services[0].internal_port if services else 0
    out = []
    for i, check in enumerate(machine.config.checks):
        internal = check.port or first
        out.append(
            CheckSpec(
                name=check.name or f"check-{i}",
                kind="http" if check.WhichOneof("kind") == "http" else "tcp",
                host=host,
                port=ports.get(internal, 0),
                path=check.http.path or "/",
                method=check.http.method or "GET",
                interval=seconds(check.interval, DEFAULT_CHECK_INTERVAL),
                timeout=seconds(check.timeout, DEFAULT_CHECK_TIMEOUT),
                internal_port=internal,
            )
        )
    return out


async def tcp(host: str, port: int, timeout: float) -> str | None:
    """Whether host:port accepts a connection within `timeout` s: None, else why not."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except ConnectionRefusedError:
        return "nothing listening"
    except OSError as err:
        return err.strerror or type(err).__name__
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def http(host: str, port: int, path: str, method: str, timeout: float) -> str | None:
    """Whether `method path` on host:port answers 2xx or 3xx within `timeout` s: None, else
    why not ("answered 500", "nothing listening", ...)."""
    method, path = method or "GET", path or "/"
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(
                    f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    "User-Agent: nonomad-check\r\nConnection: close\r\n\r\n".encode("latin-1")
                )
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        return f"{method} {path}: no answer within {timeout:g}s"
    except ConnectionRefusedError:
        return f"{method} {path}: nothing listening"
    except (OSError, UnicodeEncodeError, ValueError) as err:
        return f"{method} {path}: {getattr(err, 'strerror', None) or type(err).__name__}"
    parts = line[:CHECK_HEAD_LIMIT].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return f"{method} {path}: not an HTTP answer"
    status = int(parts[1])
    return None if 200 <= status < 400 else f"{method} {path} answered {status}"


async def run(check: CheckSpec) -> str | None:
    """Run one check: None when it passed, else why not."""
    if not check.port:
        return f"port {check.internal_port} is not a service of the machine"
    if check.kind == "http":
        return await http(check.host, check.port, check.path, check.method, check.timeout)
    return await tcp(check.host, check.port, check.timeout)
