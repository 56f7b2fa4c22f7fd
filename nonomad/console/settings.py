"""The console's settings (env prefix `CONSOLE_`): where it serves, and where it reads from.

It serves HTTP (for the loopback, by default) and reads the cluster three ways: its own
registry replica following flaps' (`upstream`: flaps' cluster port, mutual TLS with the
console's certificate), flaps' client port with a read-only token (`flaps`, `token_file`),
and the proxy's admin API (`proxy`, mutual TLS).
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
        description="HTTP listen address host:port; port 0 picks a free port (the console "
        "serves plain HTTP: tls_cert and tls_key are its identity to the cluster's parts)",
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

    @field_validator("token_file", "flaps_ca")
    @classmethod
    def _file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"file not found: {value}")
        return value

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
