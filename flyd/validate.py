"""Request validation shared by flyd and flaps: each failure names the field."""

from __future__ import annotations

import re
import signal as signals

from google.protobuf.duration_pb2 import Duration

from flyd.errors import InvalidArgument
from flyd.images import parse_reference
from flyd.v1 import machine_pb2 as pb

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_STOP_TIMEOUT = 300.0
MAX_ENV = 256
MAX_METADATA = 64
MAX_VALUE_BYTES = 4096
# Limits of a single guest; a worker's own capacity is checked separately.
MAX_CPU_MILLICORES = 64_000
MAX_MEMORY_MIB = 256 * 1024


def check_name(field: str, value: str, *, required: bool = True) -> None:
    if not value:
        if required:
            raise InvalidArgument(field, "is required")
        return
    if not NAME_RE.match(value):
        raise InvalidArgument(
            field,
            f"{value!r} must be 1-63 lowercase letters, digits or dashes, "
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
    raise InvalidArgument(field, f"unknown signal {name!r}")


def duration_seconds(
    field: str, value: Duration, *, default: float, maximum: float, present: bool
) -> float:
    if not present:
        return default
    seconds = value.seconds + value.nanos / 1e9
    if seconds < 0:
        raise InvalidArgument(field, "must not be negative")
    if seconds > maximum:
        raise InvalidArgument(field, f"must be at most {maximum:g}s")
    return seconds


def check_config(config: pb.MachineConfig, field: str = "config") -> None:
    """Everything about a machine config that can be checked without a worker."""
    if not config.image:
        raise InvalidArgument(f"{field}.image", "is required")
    try:
        parse_reference(config.image)
    except InvalidArgument as err:
        raise InvalidArgument(f"{field}.image", str(err).split(": ", 1)[-1]) from None
    guest = config.guest
    if guest.cpu_millicores <= 0 or guest.cpu_millicores > MAX_CPU_MILLICORES:
        raise InvalidArgument(
            f"{field}.guest.cpu_millicores", f"must be between 1 and {MAX_CPU_MILLICORES}"
        )
    if guest.memory_mib <= 0 or guest.memory_mib > MAX_MEMORY_MIB:
        raise InvalidArgument(
            f"{field}.guest.memory_mib", f"must be between 1 and {MAX_MEMORY_MIB}"
        )
    if guest.disk_mib < 0:
        raise InvalidArgument(f"{field}.guest.disk_mib", "must not be negative")
    for i, arg in enumerate([*config.entrypoint, *config.cmd]):
        if "\x00" in arg:
            raise InvalidArgument(f"{field}.cmd[{i}]", "must not contain NUL")
    if len(config.env) > MAX_ENV:
        raise InvalidArgument(f"{field}.env", f"at most {MAX_ENV} variables")
    for key, value in config.env.items():
        if not ENV_KEY_RE.match(key):
            raise InvalidArgument(f"{field}.env", f"invalid variable name {key!r}")
        if "\x00" in value or len(value) > MAX_VALUE_BYTES:
            raise InvalidArgument(f"{field}.env[{key}]", "must be under 4 KiB without NUL")
    ports: set[int] = set()
    for i, svc in enumerate(config.services):
        where = f"{field}.services[{i}]"
        if not 1 <= svc.internal_port <= 65535:
            raise InvalidArgument(f"{where}.internal_port", "must be between 1 and 65535")
        if svc.internal_port in ports:
            raise InvalidArgument(f"{where}.internal_port", f"{svc.internal_port} is repeated")
        ports.add(svc.internal_port)
        if svc.min_machines_running < 0:
            raise InvalidArgument(f"{where}.min_machines_running", "must not be negative")
        soft, hard = svc.concurrency.soft_limit, svc.concurrency.hard_limit
        if soft < 0 or hard < 0:
            raise InvalidArgument(f"{where}.concurrency", "limits must not be negative")
        if soft and hard and soft > hard:
            raise InvalidArgument(f"{where}.concurrency", "soft_limit must not exceed hard_limit")
    for i, check in enumerate(config.checks):
        where = f"{field}.checks[{i}]"
        if check.WhichOneof("kind") is None:
            raise InvalidArgument(where, "needs http or tcp")
        if check.port and check.port not in ports:
            raise InvalidArgument(f"{where}.port", f"{check.port} is not a service port")
        if not check.port and not ports:
            raise InvalidArgument(f"{where}.port", "is required when there are no services")
        if check.HasField("http") and not check.http.path.startswith("/"):
            raise InvalidArgument(f"{where}.http.path", "must start with /")
        for name in ("interval", "timeout"):
            duration_seconds(
                f"{where}.{name}",
                getattr(check, name),
                default=0,
                maximum=3600,
                present=check.HasField(name),
            )
    if config.restart.max_retries < 0:
        raise InvalidArgument(f"{field}.restart.max_retries", "must not be negative")
    if config.restart.mode not in pb.RestartMode.values():
        raise InvalidArgument(f"{field}.restart.mode", f"unknown mode {config.restart.mode}")
    parse_signal(f"{field}.stop.signal", config.stop.signal)
    duration_seconds(
        f"{field}.stop.timeout",
        config.stop.timeout,
        default=10,
        maximum=MAX_STOP_TIMEOUT,
        present=config.stop.HasField("timeout"),
    )
    for i, standby in enumerate(config.standbys):
        check_name(f"{field}.standbys[{i}]", standby)
    placement = config.placement
    if placement.max_per_worker < 0:
        raise InvalidArgument(f"{field}.placement.max_per_worker", "must not be negative")
    for key in placement.required_labels:
        if not key or len(key) > 128:
            raise InvalidArgument(f"{field}.placement.required_labels", "keys are 1-128 chars")
    if len(config.metadata) > MAX_METADATA:
        raise InvalidArgument(f"{field}.metadata", f"at most {MAX_METADATA} entries")
    for key, value in config.metadata.items():
        if not key or len(key) > 128 or len(value) > MAX_VALUE_BYTES:
            raise InvalidArgument(f"{field}.metadata", f"entry {key[:32]!r} is too long or empty")
