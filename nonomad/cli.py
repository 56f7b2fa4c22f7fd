"""`nonomad`: run a local cluster, and run machines on any cluster through flaps.

local cluster:
  nonomad up                  flaps, a proxy and workers (2 regions x 2); Ctrl-C stops all
  nonomad status              what each local worker says about itself
  nonomad down                stop the cluster `up` runs from --state-dir

through flaps (--flaps HOST:PORT, $NONOMAD_FLAPS, or the local cluster's):
  nonomad machines list|show|run|start|stop|restart|destroy|logs|wait
  nonomad regions             free capacity per region (--cpu --memory: how many fit)
  nonomad workers             the workers flaps knows
  nonomad image build DIR     an image the workers can pull (the local cluster's by default)
  nonomad image list          the images there, and which apps may run each
  nonomad deploy APP_TOML     make an app's machines match its spec, with standbys
  nonomad secrets set|unset|list APP  an app's secrets: values reach its machines only
  nonomad tokens create|attenuate|show|keygen|retire  tokens for flaps (macaroons)

Commands that print data take --json. Exit codes: 0 ok, 1 an error from the platform, 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from nonomad import cli_args
from nonomad.cli_common import (
    DEFAULT_STATE_DIR,
    CliError,
    Parser,
    UsageError,
    connection_parser,
    describe,
    output_parser,
    quiet_broken_pipe,
)

# Commands are named "module:function" and imported only when they run: the SDK, grpc and the
# services' modules cost a second of start-up that `--help` and a usage error need not pay.
Command = Callable[[argparse.Namespace], int]


def parser() -> argparse.ArgumentParser:
    top = Parser(
        prog="nonomad", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    top.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="where the local cluster keeps its state and logs (default %(default)s)",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    conn, out = connection_parser(), output_parser()
    up = sub.add_parser("up", help="start a local cluster in the foreground")
    up.add_argument("--regions", default="ams,syd", help="comma-separated region names")
    up.add_argument("--workers-per-region", type=int, default=2)
    up.add_argument(
        "--base-port",
        type=int,
        default=20000,
        help="first host port handed to machines (each worker gets 100)",
    )
    up.add_argument(
        "--proxy-port",
        type=int,
        default=8080,
        help="HTTP port of the proxy on 127.0.0.1 (0 picks a free one)",
    )
    up.add_argument(
        "--console-port",
        type=int,
        default=8090,
        help="HTTP port of the web console on 127.0.0.1 (0 picks a free one)",
    )
    up.add_argument(
        "--worker-memory",
        type=int,
        default=1024,
        metavar="MIB",
        help="memory each worker's flyd may use, with what it starts (netd, wrappers): a "
        "cgroup v1 memory limit of its own, so no machine can make it take the host's "
        "(default %(default)s; at least 128; 0: no limit)",
    )
    up.add_argument("--demo", action="store_true", help="deploy the demo app in every region")
    up.add_argument(
        "--hosts",
        type=int,
        default=0,
        metavar="N",
        help="run each part on a network-namespace host of its own, with N worker hosts "
        "(nonomad.hosts; root): reached on 127.0.0.1 through forwarded ports",
    )
    up.set_defaults(func="nonomad.cli_hosts:cmd_up")
    status = sub.add_parser(
        "status", parents=[out], help="what each worker of the local cluster says about itself"
    )
    status.set_defaults(func="nonomad.cli_local:cmd_status")
    down = sub.add_parser("down", help="stop the cluster `up` runs")
    down.set_defaults(func="nonomad.cli_local:cmd_down")
    cli_args.add_machines(sub, conn, out)
    cli_args.add_platform(sub, conn, out)
    cli_args.add_deploy(sub, conn, out)
    cli_args.add_image(sub, out)
    cli_args.add_tokens(sub, out)
    cli_args.add_secrets(sub, conn, out)
    return top


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; what follows the first `--` is the machine's command.

    argparse cannot take a trailing command after an earlier positional (`run APP ... -- CMD`)
    by itself, so the tail is split off first and handed to the commands that take one.
    """
    top = parser()
    tail: list[str] | None = None
    if "--" in argv:
        at = argv.index("--")
        argv, tail = argv[:at], argv[at + 1 :]
    args = top.parse_args(argv)
    if tail is not None:
        if not hasattr(args, "cmd_argv"):
            top.error(f"unexpected arguments after --: {' '.join(tail)}")
        args.cmd_argv = [*args.cmd_argv, *tail]
    return args


def command(func: str | Command) -> Command:
    """A command given as a function or as "module:function" (imported now)."""
    if callable(func):
        return func
    module, _, name = func.partition(":")
    found: Command = getattr(importlib.import_module(module), name)
    return found


MIN_WORKER_MEMORY = 128
"""The least `up --worker-memory` (MiB) a flyd starts in (it has about 80 MiB resident)."""


def main(argv: list[str] | None = None) -> None:
    """The `nonomad` console script: exit 0 ok, 1 an error from the platform, 2 bad usage."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if getattr(args, "workers_per_region", 1) < 1:
            raise UsageError("--workers-per-region must be at least 1")
        if not (getattr(args, "worker_memory", 0) == 0 or args.worker_memory >= MIN_WORKER_MEMORY):
            # Less and flyd would be OOM-killed while it starts, saying nothing of why.
            raise UsageError(
                f"--worker-memory must be 0 (no limit) or at least {MIN_WORKER_MEMORY} (MiB)"
            )
        code = command(args.func)(args)
        sys.stdout.flush()
    except CliError as err:
        print(f"nonomad: {err}", file=sys.stderr)
        code = err.exit_code
    except Exception as err:
        # An SDK error a command did not handle itself (`cli_common.run` does): one line too.
        client = sys.modules.get("nonomad.client")
        if client is None or not isinstance(err, client.ApiError):
            raise
        print(f"nonomad: {describe(err, 'flaps')}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # `nonomad ... | head`: the reader has what it wanted
        quiet_broken_pipe()
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()


if __name__ == "__main__":
    main()
