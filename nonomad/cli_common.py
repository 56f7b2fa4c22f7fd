"""What every `nonomad` command shares: errors and exit codes, the connection flags and
`connect`, the local cluster's record, and output (aligned tables or JSON).

A command that talks to flaps takes `connection_parser()` and `output_parser()` as argparse
parents and, inside its coroutine, opens `connect(args)`:

    sub.add_parser("deploy", parents=[connection_parser(), output_parser()])

    async def deploy(args):
        async with connect(args) as flaps:
            ...

`run(args, body)` does that and turns SDK errors into one-line messages; `main` in
`nonomad.cli` turns `CliError` into exit code 1 and `UsageError` into 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# This module is imported to build the parser: the SDK (grpc, protobuf) is imported only where
# a command uses it, so `--help` and usage errors start in a tenth of the time.
if TYPE_CHECKING:
    from google.protobuf.timestamp_pb2 import Timestamp

    from nonomad.client import ApiError, Client, Machine

DEFAULT_STATE_DIR = Path(".nonomad/cluster")
FLAPS_ENV = "NONOMAD_FLAPS"
TOKEN_ENV = "NONOMAD_TOKEN"
CLUSTER_FILE = "cluster.json"  # written by `nonomad up`: where its services listen
PID_FILE = "up.pid"
MAX_WAIT_CALL = 60.0  # flaps' WaitMachine limit; longer waits are several calls
DEFAULT_WAIT = 60.0
HINT = "is a cluster running? `nonomad up`"
TLS_HINT = (
    "does it serve TLS (--tls, --tls-ca) or want a client certificate (--tls-cert, --tls-key)?"
)


class CliError(Exception):
    """Something went wrong that the user can act on: one line on stderr, exit code 1."""

    exit_code = 1


class UsageError(CliError):
    """The command line is wrong: one line on stderr, exit code 2."""

    exit_code = 2


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


# -- the local cluster that `nonomad up` runs --------------------------------------------------


@dataclass
class LocalCluster:
    """Where the services of a running `nonomad up` listen, as `up` recorded them, and its
    security: the CA that signed flaps' certificate and the admin token (empty: plaintext)."""

    flaps: str
    proxy: str
    http: str
    image_source: str
    ca: str = ""
    token_file: str = ""

    def save(self, state_dir: Path) -> None:
        (state_dir / CLUSTER_FILE).write_text(json.dumps(asdict(self), indent=2))


def pid_alive(pid: int) -> bool:
    """Whether pid runs; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it died while being read
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def local_cluster(state_dir: Path) -> LocalCluster | None:
    """The cluster `nonomad up` runs from `state_dir`, or None when none runs there."""
    try:
        pid = int((state_dir / PID_FILE).read_text())
        record = json.loads((state_dir / CLUSTER_FILE).read_text())
        cluster = LocalCluster(**record)
    except (OSError, ValueError, TypeError):
        return None
    return cluster if pid_alive(pid) else None


def state_dir(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "state_dir", None) or DEFAULT_STATE_DIR).absolute()


# -- connecting to flaps -----------------------------------------------------------------------


def connection_parser() -> Parser:
    """The flags of every command that talks to flaps (an argparse parent parser)."""
    parent = Parser(add_help=False)
    group = parent.add_argument_group("connection to flaps")
    group.add_argument(
        "--flaps",
        metavar="HOST:PORT",
        help=f"the flaps to talk to (default: ${FLAPS_ENV}, else the flaps of the local "
        "cluster `nonomad up` runs from --state-dir)",
    )
    group.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=f"the token to present (`nonomad tokens create`; default: ${TOKEN_ENV}, else the "
        "local cluster's admin token)",
    )
    group.add_argument("--tls", action="store_true", help="use TLS (implied by the --tls-* files)")
    group.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA bundle to verify flaps")
    group.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mTLS)")
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="client key (mTLS)")
    group.add_argument(
        "--tls-server-name", metavar="NAME", help="name to check in flaps' certificate"
    )
    group.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds each call may take (default 30); for waits (--wait, `machines wait`), "
        f"how long to wait (default {DEFAULT_WAIT:g})",
    )
    return parent


def output_parser() -> Parser:
    """The shared `--json` flag (an argparse parent parser)."""
    parent = Parser(add_help=False)
    parent.add_argument("--json", action="store_true", help="machine-readable JSON output")
    return parent


def flaps_address(args: argparse.Namespace) -> str:
    """--flaps, else $NONOMAD_FLAPS, else the local cluster's flaps; checked as HOST:PORT."""
    address = getattr(args, "flaps", None) or os.environ.get(FLAPS_ENV, "")
    where = "--flaps" if getattr(args, "flaps", None) else f"${FLAPS_ENV}"
    if not address:
        cluster = local_cluster(state_dir(args))
        if cluster is None:
            raise UsageError(
                f"no flaps to talk to: pass --flaps HOST:PORT, set {FLAPS_ENV}, or start a "
                f"local cluster with `nonomad up` (none runs from {state_dir(args)})"
            )
        return cluster.flaps
    # Checked here rather than with runtime.settings, whose pydantic import would cost
    # every command more start-up time than the whole check is worth.
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{where}: expected HOST:PORT, got {address!r}")
    return address


def _readable(flag: str, path: Path | None) -> Path | None:
    if path is not None and not os.access(path, os.R_OK):
        raise UsageError(f"{flag}: cannot read {path}")
    return path


def connect(args: argparse.Namespace) -> Client:
    """A Client for the flaps the connection flags name; call it in the command's coroutine.

    The local cluster's flaps (no --flaps, no $NONOMAD_FLAPS) is verified with its CA and
    given its admin token, unless flags say otherwise. Raises UsageError (naming the flag) for
    an unusable flag. Nothing is sent until the first call, so an unreachable flaps shows as
    that call's error (see `describe`).
    """
    from nonomad.client import ChannelTLS, Client

    address = flaps_address(args)
    local = None
    if not getattr(args, "flaps", None) and not os.environ.get(FLAPS_ENV):
        local = local_cluster(state_dir(args))
    token_file = _readable("--token-file", getattr(args, "token_file", None))
    token = None if token_file else os.environ.get(TOKEN_ENV, "").strip() or None
    if token_file is None and token is None and local is not None and local.token_file:
        token_file = Path(local.token_file)
    ca = _readable("--tls-ca", getattr(args, "tls_ca", None))
    if ca is None and local is not None and local.ca:
        ca = Path(local.ca)
    cert = _readable("--tls-cert", getattr(args, "tls_cert", None))
    key = _readable("--tls-key", getattr(args, "tls_key", None))
    server_name = getattr(args, "tls_server_name", None)
    if (cert is None) != (key is None):
        raise UsageError("--tls-cert and --tls-key go together; give both or neither")
    tls = None
    if getattr(args, "tls", False) or ca or cert or server_name:
        tls = ChannelTLS(ca=ca, cert=cert, key=key, server_name=server_name)
    timeout = getattr(args, "timeout", None)
    if timeout is not None and timeout <= 0:
        raise UsageError(f"--timeout: must be more than 0 seconds, got {timeout:g}")
    try:
        return Client(address, tls=tls, token=token, token_file=token_file, timeout=timeout or 30.0)
    except OSError as err:
        raise UsageError(f"cannot read the TLS or token files: {err}") from None


def wait_budget(args: argparse.Namespace) -> float:
    """How long a wait (--wait, `machines wait`) may take: --timeout, else 60 s."""
    timeout = getattr(args, "timeout", None)
    return DEFAULT_WAIT if timeout is None else float(timeout)


def describe(err: ApiError, address: str) -> str:
    """One line for an SDK error: the status and message, an unreachable flaps explained."""
    if err.code.name == "UNAVAILABLE" and (
        "failed to connect" in err.message or "DNS resolution failed" in err.message
    ):
        if any(sign in err.message.lower() for sign in ("socket closed", "handshake", "ssl")):
            # The connection opened and then failed: its TLS does not match flaps'.
            return f"cannot reach flaps at {address} ({err.message}); {TLS_HINT}"
        return f"cannot reach flaps at {address} ({err.message}); {HINT}"
    if err.code.name == "DEADLINE_EXCEEDED" and err.message == "Deadline Exceeded":
        return f"flaps at {address} did not answer in time; {HINT}"
    line = f"{err.code.name}: {err.message}"
    if err.code.name == "UNAUTHENTICATED":
        return f"{line}; pass --token-file FILE or set ${TOKEN_ENV} (`nonomad tokens create`)"
    # Only RESOURCE_EXHAUSTED from placement has them; flaps' message usually names them too.
    if err.rejections and not all(reason in err.message for reason in err.rejections):
        by_reason = ", ".join(
            f"{reason}={n}" for reason, n in sorted(err.rejections.items(), key=lambda i: -i[1])
        )
        line += f" [rejections: {by_reason}]"
    return line


def run(args: argparse.Namespace, body: Callable[[Client], Awaitable[int]]) -> int:
    """Run `body` with a connected Client; SDK errors become CliError with one clear line."""
    from nonomad.client import ApiError

    async def go() -> int:
        async with connect(args) as flaps:
            try:
                return await body(flaps)
            except ApiError as err:
                raise CliError(describe(err, flaps.address)) from None

    return asyncio.run(go())


# -- output ------------------------------------------------------------------------------------


def table(rows: Iterable[Iterable[object]], header: list[str]) -> str:
    """Rows as left-aligned columns under an upper-case header."""
    text = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in text) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in text
    )


def to_json(value: Any) -> Any:
    """Messages (also inside lists and dicts) as ProtoJSON dicts with proto field names."""
    from google.protobuf import json_format
    from google.protobuf.message import Message

    if isinstance(value, Message):
        options: dict[str, Any] = {
            "preserving_proto_field_name": True,
            "always_print_fields_with_no_presence": True,
        }
        try:  # int64 fields (capacities) as JSON numbers, not ProtoJSON's strings
            return json_format.MessageToDict(value, **options, unquote_int64_if_possible=True)
        except TypeError:  # a protobuf before 7.35 (pyproject allows 5.28): strings it is
            return json_format.MessageToDict(value, **options)
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def print_json(value: Any) -> None:
    print(json.dumps(to_json(value), indent=2))


def emit(args: argparse.Namespace, value: Any, human: Callable[[], str]) -> None:
    """`value` as JSON with --json, else the human text."""
    if getattr(args, "json", False):
        print_json(value)
    else:
        print(human())


def when(ts: Timestamp, now: float | None = None) -> str:
    """A timestamp as `2024-05-01 12:00:03Z (4s ago)`; "-" when unset."""
    if not ts.seconds and not ts.nanos:
        return "-"
    return f"{ts.ToDatetime():%Y-%m-%d %H:%M:%S}Z ({ago(ts, now)})"


def ago(ts: Timestamp, now: float | None = None) -> str:
    """How long ago `ts` was, coarsely: 4s, 3m, 2h, 5d."""
    if not ts.seconds and not ts.nanos:
        return "-"
    seconds = max(0.0, (time.time() if now is None else now) - ts.ToNanoseconds() / 1e9)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{seconds:.0f}s ago" if seconds >= 1 else f"{seconds:.1f}s ago"


def key_values(pairs: Iterable[tuple[str, object]]) -> str:
    """`key  value` lines, the values aligned."""
    items = [(k, str(v)) for k, v in pairs]
    width = max((len(k) for k, _ in items), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in items)


def quiet_broken_pipe() -> None:
    """`nonomad ... | head` ends quietly: stdout goes to /dev/null for the exit flush."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


async def wait_state(
    flaps: Client,
    machine_id: str,
    state: str,
    budget: float,
    instance_id: str = "",
    *,
    ready: bool = False,
) -> Machine:
    """Wait up to `budget` seconds for the machine to be in `state` (as `instance_id`, when
    given; with `ready`, started and ready), in calls of at most 60 s.

    Raises the SDK's DeadlineExceeded (whose message says the state it is in) when time runs out.
    """
    from nonomad.client import DeadlineExceeded

    deadline = time.monotonic() + budget
    while True:
        left = deadline - time.monotonic()
        try:
            return await flaps.wait_machine(
                machine_id,
                state,
                wait=round(max(0.1, min(left, MAX_WAIT_CALL)), 1),
                instance_id=instance_id,
                ready=ready,
            )
        except DeadlineExceeded:
            if deadline - time.monotonic() <= 0:
                raise
