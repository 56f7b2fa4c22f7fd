"""Settings shared by every nonomad service, loaded from flags, environment and a TOML file.

Each service subclasses `ServiceSettings`, adds its own fields and sets its own
`env_prefix`::

    class FlydSettings(ServiceSettings):
        model_config = SettingsConfigDict(env_prefix="FLYD_")

        capacity: Capacity = Capacity()

and loads them with `load_settings(FlydSettings, argv, prog="flyd")`. The sources, highest
precedence first: command-line flags (`--grace-period 3`, `--capacity.memory-mib 512`),
environment variables (`FLYD_GRACE_PERIOD`, `FLYD_CAPACITY__MEMORY_MIB`), the TOML file named
by `--config` or `FLYD_CONFIG` (keys are field names, nested models are tables), defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn, TypeVar

import pydantic
import pydantic_settings
from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from runtime.tracing import CLUSTER_NAME, ChannelTLS
from runtime.validate import parse_host_port

__all__ = [
    "ServiceSettings",
    "SettingsError",
    "load_settings",
    "settings_or_exit",
]

S = TypeVar("S", bound="ServiceSettings")


@dataclass(frozen=True)
class _Load:
    """What `load_settings` adds to the plain sources: flags and a TOML file."""

    args: list[str]
    prog: str
    toml_file: Path | None


# The load in progress. `settings_customise_sources` is a classmethod without a way to pass
# arguments, and a context variable keeps concurrent loads (tests) apart.
_load: ContextVar[_Load | None] = ContextVar("nonomad_settings_load", default=None)


class SettingsError(pydantic_settings.SettingsError):
    """Settings could not be loaded; the message names each bad setting and why, one per line."""


def _existing_file(path: Path | None) -> Path | None:
    if path is not None and not path.is_file():
        raise ValueError(f"file not found: {path}")
    return path


class ServiceSettings(BaseSettings):
    """Settings every nonomad service has.

    Subclasses set `model_config = SettingsConfigDict(env_prefix="FLYD_")` (or their own
    prefix); the base prefix `NONOMAD_` only matters when the base class is used directly.
    """

    model_config = SettingsConfigDict(
        env_prefix="NONOMAD_",
        env_nested_delimiter="__",
        # Flag spelling: `--grace-period`, `--capacity.memory-mib`.
        cli_kebab_case=True,
        # Errors become SettingsError so load_settings can report them in one format.
        cli_exit_on_error=False,
        cli_hide_none_type=True,
        cli_avoid_json=True,
        cli_implicit_flags=True,
        # A typo in a TOML key or a keyword argument is an error, not a silently ignored value.
        extra="forbid",
    )

    config: Path | None = Field(
        default=None,
        description="TOML file with settings; flags and environment variables override it",
    )
    listen: str = Field(
        default="127.0.0.1:0",
        description="gRPC listen address host:port; port 0 picks a free port",
    )
    ready_file: Path | None = Field(
        default=None,
        description="once serving, write {service, address, pid} as JSON to this file",
    )
    grace_period: float = Field(
        default=5.0,
        gt=0,
        description="seconds in-flight calls and background tasks get to finish on shutdown",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="minimum level of log lines"
    )
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="largest gRPC message accepted or sent, in bytes",
    )
    tls_cert: Path | None = Field(
        default=None, description="PEM certificate chain; serves TLS when set (with tls_key)"
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    tls_client_ca: Path | None = Field(
        default=None,
        description="PEM CA bundle; when set, clients must present a certificate it signed",
    )
    cluster_ca: Path | None = Field(
        default=None,
        description="PEM CA of the cluster: this service checks it signed the services it calls "
        "and presents tls_cert to them as its client certificate (mutual TLS)",
    )
    cluster_listen: str | None = Field(
        default=None,
        description="a second gRPC listen address host:port for the cluster's own parts: "
        "mutual TLS only, with client certificates cluster_ca signed",
    )
    metrics_listen: str | None = Field(
        default=None,
        description="host:port serving Prometheus metrics at /metrics over HTTP; port 0 picks one",
    )

    loop_lag_interval: float | None = Field(
        default=None,
        gt=0,
        description="seconds between wake-ups of a timer that measures how late the event loop "
        "runs (nonomad_event_loop_lag_seconds); off when unset",
    )
    event_loop: Literal["uvloop", "asyncio"] = Field(
        default="uvloop",
        description="event loop: uvloop (a sixth to a quarter less CPU per request, gRPC and "
        "HTTP alike) or asyncio's own",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @field_validator("metrics_listen", "cluster_listen")
    @classmethod
    def _check_optional_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value

    @field_validator("tls_cert")
    @classmethod
    def _check_tls_cert(cls, value: Path | None) -> Path | None:
        return _existing_file(value)

    # Fields validate in declaration order, so these see tls_cert in `info.data` (when it was
    # valid); defaults are validated too (BaseSettings sets validate_default).
    @field_validator("tls_key")
    @classmethod
    def _check_tls_key(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        cert_given = info.data.get("tls_cert") is not None
        if value is None and cert_given:
            raise ValueError("required when tls_cert is set")
        if value is not None and not cert_given and "tls_cert" in info.data:
            raise ValueError("set without tls_cert; set both or neither")
        return _existing_file(value)

    @field_validator("tls_client_ca")
    @classmethod
    def _check_tls_client_ca(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and info.data.get("tls_cert") is None and "tls_cert" in info.data:
            raise ValueError("mutual TLS needs a server certificate; set tls_cert and tls_key")
        return _existing_file(value)

    @field_validator("cluster_ca")
    @classmethod
    def _check_cluster_ca(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and info.data.get("tls_cert") is None and "tls_cert" in info.data:
            raise ValueError("the cluster's services want a client certificate: set tls_cert")
        return _existing_file(value)

    @field_validator("cluster_listen")
    @classmethod
    def _check_cluster_listen(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("cluster_ca") is None and "cluster_ca" in info.data:
            raise ValueError("needs cluster_ca (and tls_cert, tls_key) for its mutual TLS")
        return value

    @property
    def cluster_tls(self) -> ChannelTLS | None:
        """How this service's channels to other parts of the cluster verify them and identify
        it: the cluster CA and its own certificate. None without cluster_ca (plaintext)."""
        if self.cluster_ca is None:
            return None
        return ChannelTLS(
            ca=self.cluster_ca, cert=self.tls_cert, key=self.tls_key, server_name=CLUSTER_NAME
        )

    @property
    def tls_enabled(self) -> bool:
        """Whether the service serves TLS (validation guarantees cert and key come together)."""
        return self.tls_cert is not None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags, keyword arguments, environment, TOML file, in that order of precedence.

        Flags and the TOML file only take part inside `load_settings`; a plain
        `FlydSettings(...)` reads keyword arguments and the environment. Dotenv and secret
        files are left out on purpose: one file format is enough.
        """
        load = _load.get()
        sources: list[PydanticBaseSettingsSource] = []
        if load is not None:
            sources.append(
                CliSettingsSource(settings_cls, cli_parse_args=load.args, cli_prog_name=load.prog)
            )
        sources += [init_settings, env_settings]
        if load is not None and load.toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=load.toml_file))
        return tuple(sources)


def _config_path(cls: type[ServiceSettings], argv: Sequence[str]) -> Path | None:
    """The TOML file named by `--config` or `<PREFIX>CONFIG`, needed before the real parse."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(list(argv))
    if known.config:
        return Path(known.config)
    # Same lookup as the env source: names are case-insensitive unless configured otherwise.
    name = f"{cls.model_config.get('env_prefix', '')}config"
    if cls.model_config.get("case_sensitive"):
        value = os.environ.get(name)
    else:
        value = next((v for k, v in os.environ.items() if k.lower() == name.lower()), None)
    return Path(value) if value else None


def _describe(error: pydantic.ValidationError, prog: str) -> str:
    lines = []
    for item in error.errors(include_url=False):
        name = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        # A check across settings (a model validator) has no one field: its message names them.
        lines.append(f"{prog}: invalid setting {name}: {message}" if name else f"{prog}: {message}")
    return "\n".join(lines)


@contextmanager
def _loading(load: _Load) -> Iterator[None]:
    token = _load.set(load)
    try:
        yield
    finally:
        _load.reset(token)


def load_settings(cls: type[S], argv: Sequence[str] | None, *, prog: str) -> S:
    """Load `cls` from flags (`argv`; None means `sys.argv[1:]`), environment, TOML, defaults.

    Raises SettingsError naming each invalid setting, e.g.
    `flyd: invalid setting grace_period: Input should be greater than 0`, and for a config
    file that does not exist or does not parse. `--help` prints usage and exits 0.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    config = _config_path(cls, args)
    if config is not None:
        if not config.is_file():
            raise SettingsError(f"{prog}: invalid setting config: file not found: {config}")
        try:
            with config.open("rb") as fh:
                tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"{prog}: invalid setting config: {config}: {exc}") from exc
    try:
        with _loading(_Load(args=args, prog=prog, toml_file=config)):
            return cls()
    except pydantic.ValidationError as exc:
        raise SettingsError(_describe(exc, prog)) from exc
    except pydantic_settings.SettingsError as exc:
        # Flags that do not parse ("unrecognized arguments", a bad JSON value, ...).
        raise SettingsError(f"{prog}: {exc}") from exc


def settings_or_exit(cls: type[S], argv: Sequence[str] | None, prog: str) -> S:
    """`load_settings` for a `main()`: on bad settings, print why to stderr and exit 2."""
    try:
        return load_settings(cls, argv, prog=prog)
    except SettingsError as exc:
        _exit_with(str(exc))


def _exit_with(message: str) -> NoReturn:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)
