"""Checks of a machine config that need no worker: shared by flyd and flaps (and the deploy
spec). The generic field checks (names, signals, durations) live in `runtime.validate`.

`CONFIG_LIMITS` bounds a config's size and each of its lists and strings; flyd and flaps
check them as a request is decoded (`runtime.limits`), before `check_config` sees it, so that
no tenant can make a row, a snapshot or a list answer grow without bound.
"""

from __future__ import annotations

from flyd.v1 import machine_pb2 as pb
from model.errors import InvalidArgument
from model.images.reference import parse_reference
from runtime.limits import Limits
from runtime.validate import check_name, duration_seconds, is_env_key, parse_signal, quote

MAX_STOP_TIMEOUT = 300.0
MAX_ENV = 256
MAX_METADATA = 64
MAX_SECRETS = 64
REDACTED = "<redacted>"
"""The value every answer shows for a secret; in an update, "keep the current value"."""
MAX_VALUE_BYTES = 4096
# Limits of a single guest; a worker's own capacity is checked separately.
MAX_CPU_MILLICORES = 64_000
MAX_MEMORY_MIB = 256 * 1024
MIN_PIDS, MAX_PIDS = 16, 32768  # GuestConfig.pids_max; 0 is the worker default
MIN_DISK_MIB, MAX_DISK_MIB = 16, 1 << 20  # GuestConfig.disk_mib, MiB (up to 1 TiB)
DEFAULT_DISK_MIB = 256
"""The disk a machine whose config says 0 gets and reserves, MiB (`guest_disk_mib`)."""
MAX_CONFIG_BYTES = 64 * 1024
MAX_ARG_CHARS = 4096

_C = "flyd.v1.MachineConfig"
CONFIG_LIMITS = Limits(
    texts={
        f"{_C}.image": 512,
        f"{_C}.entrypoint": MAX_ARG_CHARS,
        f"{_C}.cmd": MAX_ARG_CHARS,
        f"{_C}.EnvEntry.key": 256,
        f"{_C}.EnvEntry.value": MAX_VALUE_BYTES,
        f"{_C}.MetadataEntry.key": 128,
        f"{_C}.MetadataEntry.value": MAX_VALUE_BYTES,
        f"{_C}.SecretsEntry.key": 256,
        f"{_C}.SecretsEntry.value": MAX_VALUE_BYTES,
        f"{_C}.standbys": 63,
        "flyd.v1.PlacementConfig.RequiredLabelsEntry.key": 128,
        "flyd.v1.PlacementConfig.RequiredLabelsEntry.value": 256,
        "flyd.v1.CheckConfig.name": 63,
        "flyd.v1.HttpCheck.method": 16,
        "flyd.v1.StopConfig.signal": 16,
    },
    counts={
        f"{_C}.entrypoint": 64,
        f"{_C}.cmd": 256,
        f"{_C}.env": MAX_ENV,
        f"{_C}.services": 16,
        f"{_C}.checks": 16,
        f"{_C}.standbys": 16,
        f"{_C}.metadata": MAX_METADATA,
        f"{_C}.secrets": MAX_SECRETS,
        "flyd.v1.PlacementConfig.required_labels": 32,
    },
    sizes={_C: MAX_CONFIG_BYTES},
)
"""The bounds of a machine config, wherever a request carries one (flyd's and flaps')."""

# How much of a placement decision a worker keeps with a machine (flaps trims to these).
MAX_PLACEMENT_REGIONS = 16
MAX_PLACEMENT_NAMED = 16
"""Candidates, and named rejections, per region; the counts by reason cover the rest."""
MAX_PLACEMENT_DETAIL = 160
MAX_PLACEMENT_BYTES = 64 * 1024
_P = "flyd.v1.RegionPlacement"
PLACEMENT_LIMITS = Limits(
    texts={
        "flyd.v1.PlacementDecision.worker_id": 63,
        f"{_P}.region": 63,
        f"{_P}.outcome": 16,
        f"{_P}.keyed_worker_id": 63,
        f"{_P}.RejectionsByReasonEntry.key": 64,
        "flyd.v1.PlacementCandidate.worker_id": 63,
        "flyd.v1.PlacementCandidate.SubScoresEntry.key": 64,
        "flyd.v1.PlacementRejection.worker_id": 63,
        "flyd.v1.PlacementRejection.reason": 64,
        "flyd.v1.PlacementRejection.detail": MAX_PLACEMENT_DETAIL,
    },
    counts={
        "flyd.v1.PlacementDecision.regions": MAX_PLACEMENT_REGIONS,
        f"{_P}.candidates": MAX_PLACEMENT_NAMED + 1,  # and the winner, when ranked lower
        f"{_P}.rejections": MAX_PLACEMENT_NAMED,
        f"{_P}.rejections_by_reason": 32,
        "flyd.v1.PlacementCandidate.sub_scores": 8,
    },
    sizes={"flyd.v1.PlacementDecision": MAX_PLACEMENT_BYTES},
)
"""The bounds of the placement decision a create carries (`CreateMachineRequest.placement`):
it is kept with the machine for its whole life."""


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
    if guest.disk_mib and not MIN_DISK_MIB <= guest.disk_mib <= MAX_DISK_MIB:
        raise InvalidArgument(
            f"{field}.guest.disk_mib",
            f"must be 0 (the default, {DEFAULT_DISK_MIB} MiB) or between {MIN_DISK_MIB} and "
            f"{MAX_DISK_MIB}",
        )
    if guest.pids_max and not MIN_PIDS <= guest.pids_max <= MAX_PIDS:
        raise InvalidArgument(
            f"{field}.guest.pids_max",
            f"must be 0 (the default) or between {MIN_PIDS} and {MAX_PIDS}",
        )
    for i, arg in enumerate([*config.entrypoint, *config.cmd]):
        if "\x00" in arg:
            raise InvalidArgument(f"{field}.cmd[{i}]", "must not contain NUL")
    if len(config.env) > MAX_ENV:
        raise InvalidArgument(f"{field}.env", f"at most {MAX_ENV} variables")
    for key, value in config.env.items():
        if not is_env_key(key):
            raise InvalidArgument(f"{field}.env", f"invalid variable name {quote(key)}")
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
            raise InvalidArgument(
                f"{field}.metadata", f"entry {quote(key, 32)} is too long or empty"
            )
    check_secrets(config, field)


def guest_disk_mib(guest: pb.GuestConfig) -> int:
    """The disk a guest gets and reserves, MiB: its `disk_mib`, or `DEFAULT_DISK_MIB` for 0.
    Every account of a machine's disk (a worker's reservations, placement, the driver's
    filesystem of that size) goes through here, so what is reserved is what is made."""
    return guest.disk_mib or DEFAULT_DISK_MIB


def check_disk_change(old: pb.GuestConfig, new: pb.GuestConfig, field: str = "config") -> None:
    """A machine's disk grows with an update, never shrinks: what it wrote stays."""
    before, after = guest_disk_mib(old), guest_disk_mib(new)
    if after < before:
        raise InvalidArgument(
            f"{field}.guest.disk_mib",
            f"a machine's disk cannot shrink: it has {before} MiB, the update asks for {after}",
        )


EGRESS_LABEL = "nonomad.egress"
"""The label flyd gives its worker when its machines can have egress (`flyd --egress-via`, or
the process driver, whose machines share the host's network); flaps requires it of the
workers it places a machine on whose config asks for egress. Operators cannot set it."""

DISK_LABEL = "nonomad.disk"
"""The label flyd gives its worker ("limited") when what a machine writes is bounded by its
`guest.disk_mib` (the OCI driver: a filesystem of its own); a process driver's machines write
to the host's filesystem, unbounded, and their worker has no such label. Operators cannot set
it; a config can require it (`placement.required_labels`)."""


def check_network(config: pb.MachineConfig, refusal: str | None, field: str = "config") -> None:
    """A config asking for egress on a worker that cannot give it (`refusal`, the driver's
    reason) is refused, naming the field: a setting the worker ignored would be a lie."""
    if config.network.egress and refusal is not None:
        raise InvalidArgument(f"{field}.network.egress", refusal)


def check_secrets(config: pb.MachineConfig, field: str = "config") -> None:
    """Secret names follow env's rules and are not in env too; values are bounded. Nothing
    said here quotes a value."""
    if len(config.secrets) > MAX_SECRETS:
        raise InvalidArgument(f"{field}.secrets", f"at most {MAX_SECRETS} secrets")
    for key, value in config.secrets.items():
        if not is_env_key(key):
            raise InvalidArgument(f"{field}.secrets", f"invalid variable name {quote(key)}")
        if key in config.env:
            raise InvalidArgument(f"{field}.secrets[{key}]", "is also set in env; set it once")
        if "\x00" in value or len(value.encode()) > MAX_VALUE_BYTES:
            raise InvalidArgument(f"{field}.secrets[{key}]", "must be under 4 KiB without NUL")
