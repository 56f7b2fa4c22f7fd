"""Fixtures for the runtime tests: a clean environment, restored logging, test certificates."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog

from runtime.pki import OPERATOR, ClusterCA


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracing must stay off unless a test turns it on itself."""
    for name in list(os.environ):
        if name.startswith(("OTEL_", "NONOMAD_")):
            monkeypatch.delenv(name)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo configure_logging: the root logger and structlog go back to how they were."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.configure(**config)
        structlog.contextvars.clear_contextvars()


@dataclass(frozen=True)
class Certs:
    """A test CA with a server and a client certificate, and a client of another CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    ca = ClusterCA.ensure(tmp_path_factory.mktemp("certs"))
    server, client = ca.issue("server", "flaps"), ca.issue("test-client", OPERATOR)
    stranger = ClusterCA.ensure(tmp_path_factory.mktemp("stranger")).issue("test-client", OPERATOR)
    return Certs(
        ca=ca.path,
        server_cert=server.cert,
        server_key=server.key,
        client_cert=client.cert,
        client_key=client.key,
        stranger_cert=stranger.cert,
        stranger_key=stranger.key,
    )
