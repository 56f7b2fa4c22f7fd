"""The app spec: what a deploy should make of an app, written in TOML.

    app = "demo"
    image = "demo:v1"
    standbys = 1                      # per machine, 0 or 1: a stopped twin on another worker

    [regions]
    ams = 2                           # machines in each region
    syd = 1

    [guest]
    cpu_millicores = 250
    memory_mib = 128

    [env]
    GREETING = "hello"

    [[services]]
    internal_port = 8080
    autostart = true
    autostop = true
    min_machines_running = 0
    concurrency = { soft_limit = 20, hard_limit = 25 }

    [[checks]]
    type = "http"                     # or "tcp"
    path = "/"
    interval = "1s"                   # seconds as a number, or "500ms", "2s", "1m"
    timeout = "2s"
    grace_period = "10s"              # how long a deploy waits for a new machine to pass

    [restart]
    policy = "always"                 # "no", "always" or "on-failure" (with max_retries)

`load_spec` parses and validates it; every problem is reported as `<file>: <field path>:
<message>`, e.g. `app.toml: services[0].internal_port: Input should be less than 65536`.
`AppSpec.machine_config` turns it into the `flyd.v1.MachineConfig` of one machine, marked in
its metadata with the app, the region slot and a digest of the config.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from google.protobuf import json_format
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from flyd.v1 import machine_pb2 as pb
from model.errors import InvalidArgument
from model.images.reference import parse_reference
from model.validate import MAX_ENV, MAX_VALUE_BYTES, check_config
from runtime.validate import is_env_key, is_name

__all__ = [
    "AppSpec",
    "Check",
    "Guest",
    "Restart",
    "Service",
    "SpecError",
    "load_spec",
    "parse_spec",
]

# Metadata keys every deployed machine carries; the deploy finds its machines by them.
META_APP = "nonomad.deploy/app"
META_REGION = "nonomad.deploy/region"
META_SLOT = "nonomad.deploy/slot"
META_ROLE = "nonomad.deploy/role"
META_DIGEST = "nonomad.deploy/digest"
STANDBY_SUFFIX = "-standby"
MAX_NAME = 63  # flaps' limit on a machine name
MAX_PER_REGION = 100
MAX_CHECK_SECONDS = 3600.0

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


class SpecError(ValueError):
    """The spec cannot be used; `problems` has one `<file>: <field>: <message>` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _seconds(value: object) -> object:
    """A duration: a number of seconds, or a string such as "500ms", "2s", "1.5m"."""
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not a duration such as 500ms, 2s or 1m")
        return float(match.group(1)) * _UNITS[match.group(2)]
    return value


def _name(what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not is_name(value):
            raise ValueError(
                f"{what} {value!r} must be 1-63 lowercase letters, digits or dashes, "
                "starting and ending with a letter or digit"
            )
        return value

    return AfterValidator(check)


def _image(value: str) -> str:
    try:
        parse_reference(value)
    except InvalidArgument as err:
        raise ValueError(str(err).split(": ", 1)[-1]) from None
    return value


def _env_key(value: str) -> str:
    if not is_env_key(value):
        raise ValueError(
            f"{value!r} is not a variable name (letters, digits, _; not a digit first)"
        )
    return value


def _env_value(value: str) -> str:
    if "\x00" in value or len(value.encode()) > MAX_VALUE_BYTES:
        raise ValueError(f"must be under {MAX_VALUE_BYTES} bytes without NUL")
    return value


Seconds = Annotated[float, BeforeValidator(_seconds), Field(gt=0, le=MAX_CHECK_SECONDS)]
GraceSeconds = Annotated[float, BeforeValidator(_seconds), Field(ge=0, le=MAX_CHECK_SECONDS)]
Port = Annotated[int, Field(ge=1, lt=65536)]
RegionName = Annotated[str, _name("region")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Guest(_Model):
    """The size reserved for each machine."""

    cpu_millicores: int = Field(default=250, gt=0, le=64_000)
    memory_mib: int = Field(default=128, gt=0, le=256 * 1024)
    disk_mib: int = Field(default=0, ge=0)


class Concurrency(_Model):
    soft_limit: int = Field(default=0, ge=0)
    hard_limit: int = Field(default=0, ge=0)

    @pydantic.model_validator(mode="after")
    def _soft_below_hard(self) -> Concurrency:
        if self.soft_limit and self.hard_limit and self.soft_limit > self.hard_limit:
            raise ValueError(
                f"soft_limit ({self.soft_limit}) must not exceed hard_limit ({self.hard_limit})"
            )
        return self


class Service(_Model):
    """A port of the machine the edge routes to."""

    internal_port: Port
    autostart: bool = True
    autostop: bool = False
    min_machines_running: int = Field(default=0, ge=0)
    concurrency: Concurrency = Concurrency()


class Check(_Model):
    """A health check, run by the machine's worker (flyd.readiness) and the edge: the edge
    routes only to passing machines, and a deploy waits for flyd to say it passes.

    Attempts run every `interval`, each given `timeout`. Everything but `grace_period` travels
    in MachineConfig.checks; configs carry no grace period (flyd reports a failing check after
    its own --ready-grace and keeps probing), so a deploy holds it: it waits `grace_period` +
    `timeout` after a new machine started for a check flyd names as failing.
    """

    name: str = Field(default="", max_length=63)
    type: Literal["http", "tcp"]
    port: Port | None = None
    path: str | None = None
    method: Literal["GET", "HEAD"] | None = None
    interval: Seconds = 1.0
    timeout: Seconds = 2.0
    grace_period: GraceSeconds = 10.0

    @pydantic.model_validator(mode="after")
    def _http_fields(self) -> Check:
        if self.type == "tcp":
            for field in ("path", "method"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field}: only http checks take a {field}")
        elif self.path is not None and not self.path.startswith("/"):
            raise ValueError(f"path: {self.path!r} must start with /")
        return self

    def label(self, index: int) -> str:
        return self.name or f"{self.type}-{index}"


class Restart(_Model):
    """What the worker does when the machine's process exits on its own."""

    policy: Literal["no", "always", "on-failure"] = "on-failure"
    max_retries: int = Field(default=0, ge=0)

    @pydantic.model_validator(mode="after")
    def _retries_only_on_failure(self) -> Restart:
        if self.max_retries and self.policy != "on-failure":
            raise ValueError(
                f"max_retries: only the on-failure policy retries, not {self.policy!r}"
            )
        return self


_RESTART_MODES = {
    "no": pb.RESTART_MODE_NO,
    "always": pb.RESTART_MODE_ALWAYS,
    "on-failure": pb.RESTART_MODE_ON_FAILURE,
}


class AppSpec(_Model):
    """An app as a deploy should leave it."""

    app: Annotated[str, _name("app")]
    image: Annotated[str, AfterValidator(_image)]
    regions: dict[RegionName, Annotated[int, Field(ge=0, le=MAX_PER_REGION)]] = Field(min_length=1)
    standbys: int = Field(default=0, ge=0, le=1)
    guest: Guest = Guest()
    env: dict[
        Annotated[str, AfterValidator(_env_key)], Annotated[str, AfterValidator(_env_value)]
    ] = Field(default_factory=dict, max_length=MAX_ENV)
    services: list[Service] = Field(default_factory=list)
    checks: list[Check] = Field(default_factory=list)
    restart: Restart = Restart()

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> AppSpec:
        ports = [s.internal_port for s in self.services]
        for i, port in enumerate(ports):
            if port in ports[:i]:
                raise ValueError(f"services[{i}].internal_port: {port} is repeated")
        names: set[str] = set()
        for i, check in enumerate(self.checks):
            if check.port is not None and check.port not in ports:
                raise ValueError(f"checks[{i}].port: {check.port} is not a service port")
            if check.port is None and not ports:
                raise ValueError(f"checks[{i}].port: is required when there are no services")
            if check.label(i) in names:
                raise ValueError(f"checks[{i}].name: {check.label(i)!r} is repeated")
            names.add(check.label(i))
        longest = max(self.regions, key=len)
        name = self.slot(longest, max(self.regions[longest], 1), standby=True)
        if len(name) > MAX_NAME:
            raise ValueError(
                f"app: machine names such as {name!r} would be longer than {MAX_NAME} "
                "characters; use a shorter app or region name"
            )
        try:
            check_config(self.machine_config(longest, name))
        except InvalidArgument as err:  # anything the checks above missed, in flyd's words
            raise ValueError(str(err)) from None
        return self

    # -- machines ------------------------------------------------------------------------------

    def slot(self, region: str, index: int, *, standby: bool = False) -> str:
        """The stable name of machine `index` (from 1) of a region, or of its standby."""
        return f"{self.app}-{region}-{index}{STANDBY_SUFFIX if standby else ''}"

    def base_config(self) -> pb.MachineConfig:
        """What every machine of the app runs, before the per-machine metadata."""
        config = pb.MachineConfig(
            image=self.image,
            guest=pb.GuestConfig(
                cpu_millicores=self.guest.cpu_millicores,
                memory_mib=self.guest.memory_mib,
                disk_mib=self.guest.disk_mib,
            ),
            env=self.env,
            restart=pb.RestartPolicy(
                mode=_RESTART_MODES[self.restart.policy], max_retries=self.restart.max_retries
            ),
        )
        for svc in self.services:
            config.services.add(
                internal_port=svc.internal_port,
                autostart=svc.autostart,
                autostop=svc.autostop,
                min_machines_running=svc.min_machines_running,
                concurrency=pb.ConcurrencyConfig(
                    soft_limit=svc.concurrency.soft_limit, hard_limit=svc.concurrency.hard_limit
                ),
            )
        for i, check in enumerate(self.checks):
            out = config.checks.add(name=check.label(i), port=check.port or 0)
            out.interval.FromMilliseconds(round(check.interval * 1000))
            out.timeout.FromMilliseconds(round(check.timeout * 1000))
            if check.type == "http":
                out.http.path = check.path or "/"
                out.http.method = check.method or ""
            else:
                out.tcp.SetInParent()
        return config

    @property
    def digest(self) -> str:
        """A short hash of `base_config`: machines whose metadata carries another need updating.

        Computed over canonical JSON, not the wire bytes, so it does not change with the
        protobuf library."""
        canonical = json.dumps(
            json_format.MessageToDict(self.base_config(), preserving_proto_field_name=True),
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def machine_config(self, region: str, slot: str, *, standby_for: str = "") -> pb.MachineConfig:
        """The full config of the machine in `slot`; a standby names the machine it stands by
        for (flaps would add it anyway; an update must keep it)."""
        config = self.base_config()
        config.metadata.update(
            {
                META_APP: self.app,
                META_REGION: region,
                META_SLOT: slot,
                META_ROLE: "standby" if standby_for else "primary",
                META_DIGEST: self.digest,
            }
        )
        if standby_for:
            config.standbys.append(standby_for)
        return config


# -- loading -----------------------------------------------------------------------------------


def _where(loc: tuple[int | str, ...]) -> str:
    """("services", 0, "internal_port") -> "services[0].internal_port"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " (name)"
        else:
            out += f".{part}" if out else part
    return out


def _problems(error: pydantic.ValidationError, source: str) -> list[str]:
    lines = []
    for item in error.errors(include_url=False):
        message = item["msg"].removeprefix("Value error, ")
        where = _where(tuple(item["loc"]))
        # Cross-field problems carry their own path in the message ("checks[0].port: ...").
        lines.append(f"{source}: {where}: {message}" if where else f"{source}: {message}")
    return lines


def parse_spec(data: Mapping[str, Any], source: str = "app.toml") -> AppSpec:
    """Validate an already-parsed TOML document; `source` names it in errors."""
    try:
        return AppSpec.model_validate(dict(data))
    except pydantic.ValidationError as err:
        raise SpecError(_problems(err, source)) from None


def load_spec(path: Path | str) -> AppSpec:
    """Read and validate an app spec; SpecError names the file and each bad field."""
    source = str(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SpecError([f"{source}: file not found"]) from None
    except OSError as err:
        raise SpecError([f"{source}: cannot read: {err.strerror}"]) from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError([f"{source}: not valid TOML: {err}"]) from None
    return parse_spec(data, source)
