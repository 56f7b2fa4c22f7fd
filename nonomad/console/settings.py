"""The console's settings (env prefix `CONSOLE_`): where it serves, to whom, and where it
reads from.

It serves HTTP (for the loopback, by default; HTTPS with `https_cert` and `https_key`) to
`Host` names it knows (its bind address and loopback names, and `hosts`), to operators logged
in with a token (sessions of `session_ttl`, at most `max_sessions`). It reads the cluster
three ways: its own registry replica following flaps' (`upstream`: flaps' cluster port, mutual
TLS with the console's certificate), flaps' client port (`flaps`: each session with its own
token, the live feed of placements with the console's read-only `token_file`), and the
proxy's admin API (`proxy`, mutual TLS).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from registry.settings import ReplicaSettings
from runtime import ChannelTLS, parse_host_port


class ConsoleSettings(ReplicaSettings):
    """Settings of one console (any number may run: each keeps its own replica)."""

    model_config = SettingsConfigDict(env_prefix="CONSOLE_")

    listen: str = Field(
        default="127.0.0.1:8090",
        description="HTTP listen address host:port; port 0 picks a free port (plain HTTP "
        "unless https_cert is set: tls_cert and tls_key are its identity to the cluster's parts)",
    )
    hosts: list[str] = Field(
        default_factory=list,
        description="more Host names the console answers, `name` or `name:port` (a reverse "
        "proxy's, a DNS name); its listen address and localhost, 127.0.0.1 and [::1] with its "
        "port are always answered, any other Host is refused (421): that stops DNS rebinding",
    )
    https_cert: Path | None = Field(
        default=None,
        description="PEM certificate to serve HTTPS with (with https_key); its session cookie "
        "is then Secure",
    )
    https_key: Path | None = Field(default=None, description="PEM private key of https_cert")
    session_ttl: float = Field(
        default=12 * 3600.0,
        gt=0,
        description="seconds a login lasts (never past its token's expiry); an hour unused "
        "ends it sooner",
    )
    max_sessions: int = Field(
        default=256, ge=1, description="sessions held at once; the least recently used goes"
    )
    flaps: str = Field(
        description="flaps' client address host:port: machines' details, logs and placement "
        "decisions, and its placement decisions as they are made"
    )
    flaps_ca: Path | None = Field(
        default=None,
        description="PEM CA that signed flaps' certificate (default: cluster_ca); without "
        "either, flaps is called in plaintext",
    )
    token_file: Path | None = Field(
        default=None,
        description="file with the token sent to flaps: one allowing read, workers and regions "
        "on every app is all the console needs",
    )
    proxy: str | None = Field(
        default=None,
        description="the proxy's gRPC address host:port (health, load and traffic of apps); "
        "without it, pages show none",
    )

    @field_validator("flaps", "proxy")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value

    @field_validator("token_file", "flaps_ca", "https_cert", "https_key")
    @classmethod
    def _file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"file not found: {value}")
        return value

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or any(c in name for c in "/ @?#") or name != name.strip():
                raise ValueError(f"hosts: {name!r} is not a host name (or name:port)")
        return value

    @model_validator(mode="after")
    def _https_pair(self) -> ConsoleSettings:
        if (self.https_cert is None) != (self.https_key is None):
            raise ValueError("https_cert and https_key go together")
        return self

    @model_validator(mode="after")
    def _follows_something(self) -> ConsoleSettings:
        if self.upstream is None and not self.workers:
            raise ValueError(
                "the console's replica follows nothing: set upstream (flaps' cluster port) "
                "or workers"
            )
        return self

    def flaps_tls(self) -> ChannelTLS | None:
        """How the console checks flaps' certificate; None: plaintext."""
        ca = self.flaps_ca or self.cluster_ca
        return ChannelTLS(ca=ca) if ca is not None else None
