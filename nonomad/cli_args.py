"""The command line of `nonomad machines`, `regions`, `workers`, `image`, `tokens` and
`secrets`: parsers only.

Each command is named as "module:function" and imported when it runs (see `nonomad.cli`), so
building the parser, `--help` and usage errors stay quick. Argument types name what is wrong.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nonomad.cli_common import Parser
from runtime.validate import is_name

DEFAULT_CPU = 250
DEFAULT_MEMORY = 128

RUN_EPILOG = """\
Everything after `--` is the command the machine runs instead of the image's entrypoint and
cmd, e.g. `nonomad machines run web --image demo:v1 --region ams -- sh -c 'echo hi; sleep 60'`.
Images come from the workers' image source; `nonomad image build` puts one there.
"""


BUILD_EPILOG = """\
Where images go: workers pull images from their image source directory (flyd --image-source),
which holds one OCI layout per image name. `nonomad up` points every worker of the local
cluster at STATE_DIR/images, so when a local cluster runs, --out defaults to that directory and
a built image can be run at once:

  nonomad image build ./site --tag site:v1 --app site --entrypoint 'python3 -u app.py'
  nonomad machines run site --image site:v1 --region ams --port 8080

Whose it is: an image is its app's (--app): only that app's machines may run it, and the apps
it is shared with (--share-with a,b); --public lets every app run it. One of --app or --public
is needed. Who may run it is recorded in the image's manifest (docs/images.md), so the same
tree built for another app is another image, of another digest; to change it, build again.

For other workers, pass --out DIR with their --image-source directory.
--entrypoint and --cmd take a shell-like string ('python3 -u app.py') or a JSON array.

What the image runs on: without --base, the image is only DIR, and an OCI worker lends it the
host's runtime directories read-only (/usr, /lib, /bin, /etc/ssl, ...), as Nomad's exec driver
does. With --base, DIR is a layer on top of a base image of its own and nothing of the host is
lent: an OCI image layout (or a tar of one), a `docker save` archive, or a rootfs tar, e.g. a
small Debian built from Debian's packages:

  mmdebstrap --variant=minbase --include=python3-minimal bookworm debian.tar
  nonomad image build ./site --tag site:v1 --app site --base debian.tar \\
    --entrypoint 'python3 -u app.py'
"""


# -- argument types: each names what is wrong ------------------------------------------------


def env_pair(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE")
    return key, val


def app_list(value: str) -> list[str]:
    """`a,b,c` as app names."""
    apps = [a.strip() for a in value.split(",") if a.strip()]
    for app in apps:
        if not is_name(app):
            raise argparse.ArgumentTypeError(f"{app!r} is not an app name")
    if not apps:
        raise argparse.ArgumentTypeError("name at least one app")
    return apps


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {number}")
    return number


def port(value: str) -> int:
    number = positive_int(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a port (1-65535)")
    return number


def machine_state(value: str) -> str:
    from nonomad.client import parse_state, state_name  # only when --state or STATE is given

    try:
        return state_name(parse_state(value))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# -- machines --------------------------------------------------------------------------------------


def add_machines(
    sub: argparse._SubParsersAction[Parser],
    conn: Parser,
    out: Parser,
) -> None:
    """Add `machines` and its subcommands to the top-level subparsers."""
    parents = [conn, out]
    machines = sub.add_parser("machines", help="machines of an app, through flaps")
    msub = machines.add_subparsers(dest="machines_command", required=True, metavar="COMMAND")

    ls = msub.add_parser("list", parents=parents, help="an app's machines")
    ls.add_argument("app", metavar="APP", help="the app's name")
    ls.add_argument("--region", help="only this region")
    ls.add_argument("--state", type=machine_state, help="only this state (started, stopped...)")
    ls.add_argument("--all", action="store_true", help="include destroyed machines")
    ls.set_defaults(func="nonomad.cli_machines:cmd_list")

    show = msub.add_parser("show", parents=parents, help="a machine: config, ports, events")
    show.add_argument("id", metavar="ID", help="machine id")
    show.set_defaults(func="nonomad.cli_machines:cmd_show")

    why = msub.add_parser(
        "why",
        parents=parents,
        help="why a machine is on its worker: the placement decision that put it there",
    )
    why.add_argument("id", metavar="ID", help="machine id")
    why.set_defaults(func="nonomad.cli_machines:cmd_why")

    create = msub.add_parser(
        "run",
        parents=parents,
        help="create (and start) a machine",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    create.add_argument("app", metavar="APP", help="the app's name")
    create.add_argument("--image", required=True, help="image reference, NAME:TAG")
    create.add_argument("--region", required=True, help="region to place it in")
    create.add_argument(
        "--cpu", type=positive_int, default=DEFAULT_CPU, metavar="MILLI", help="millicores"
    )
    create.add_argument(
        "--memory", type=positive_int, default=DEFAULT_MEMORY, metavar="MIB", help="MiB"
    )
    create.add_argument(
        "--disk",
        type=positive_int,
        default=0,
        metavar="MIB",
        help="what its writable layer holds, MiB (default: the workers' default, 256)",
    )
    create.add_argument(
        "--env", type=env_pair, action="append", default=[], metavar="K=V", help="repeatable"
    )
    create.add_argument(
        "--secret",
        type=env_pair,
        action="append",
        default=[],
        metavar="K=V",
        help="an environment variable whose value only the machine sees (repeatable)",
    )
    create.add_argument(
        "--port",
        type=port,
        action="append",
        default=[],
        metavar="INTERNAL",
        help="a port the machine listens on ($PORT); mapped to a host port. Repeatable",
    )
    create.add_argument("--name", help="a name for the machine")
    create.add_argument(
        "--standby-for",
        action="append",
        default=[],
        metavar="ID",
        help="create a stopped standby for machine ID on another worker. Repeatable",
    )
    create.add_argument("--no-start", action="store_true", help="create it, do not start it")
    create.add_argument("--wait", action="store_true", help="wait until it is started")
    create.add_argument(
        "--idempotency-key", metavar="KEY", help="a retry with the same key names the same machine"
    )
    create.add_argument(
        "cmd_argv", nargs="*", default=[], metavar="-- CMD ARGS", help="what to run (see below)"
    )
    create.set_defaults(func="nonomad.cli_machines:cmd_run")

    for action, text in [
        ("start", "start a stopped machine"),
        ("stop", "stop a started machine"),
        ("restart", "stop and start a machine"),
        ("destroy", "destroy a machine"),
    ]:
        cmd = msub.add_parser(action, parents=parents, help=text)
        cmd.add_argument("id", metavar="ID", help="machine id")
        if action == "destroy":
            cmd.add_argument("--force", action="store_true", help="destroy even if started")
        if action in ("stop", "restart"):
            cmd.add_argument("--signal", metavar="S", help="signal name (default the config's)")
            cmd.add_argument(
                "--kill-timeout", type=float, metavar="S", help="seconds before SIGKILL"
            )
        cmd.add_argument("--wait", action="store_true", help="wait for the state it leads to")
        cmd.set_defaults(func="nonomad.cli_machines:cmd_lifecycle", action=action)

    logs = msub.add_parser("logs", parents=parents, help="a machine's log lines")
    logs.add_argument("id", metavar="ID", help="machine id")
    logs.add_argument("--tail", type=positive_int, default=100, metavar="N", help="last N lines")
    logs.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new lines; Ctrl-C ends it"
    )
    logs.set_defaults(func="nonomad.cli_machines:cmd_logs")

    wait = msub.add_parser(
        "wait", parents=parents, help="wait until a machine is in a state (--timeout S)"
    )
    wait.add_argument("id", metavar="ID", help="machine id")
    wait.add_argument("state", metavar="STATE", type=machine_state, help="started, stopped...")
    wait.set_defaults(func="nonomad.cli_machines:cmd_wait")


# -- the fleet and images ----------------------------------------------------------------------


def add_platform(
    sub: argparse._SubParsersAction[Parser],
    conn: Parser,
    out: Parser,
) -> None:
    """Add `regions` and `workers` to the top-level subparsers."""
    regions = sub.add_parser(
        "regions",
        parents=[conn, out],
        help="free capacity per region; with --cpu and --memory, how many of that size fit",
    )
    regions.add_argument("--cpu", type=positive_int, metavar="MILLI", help="machine size: CPU")
    regions.add_argument("--memory", type=positive_int, metavar="MIB", help="machine size: MiB")
    regions.set_defaults(func="nonomad.cli_platform:cmd_regions")

    workers = sub.add_parser(
        "workers",
        parents=[conn, out],
        help="the workers flaps knows; cordon|uncordon ID; kill|pause|resume|restart ID: faults "
        "on the local cluster",
        description=WORKERS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    workers.add_argument("--region", help="only this region")
    workers.add_argument(
        "action",
        nargs="?",
        choices=["cordon", "uncordon", "kill", "pause", "resume", "restart", "partition", "heal"],
        help=argparse.SUPPRESS,
    )
    workers.add_argument("worker_id", nargs="?", metavar="ID", help=argparse.SUPPRESS)
    workers.add_argument(
        "--with-machines", action="store_true", help="kill: its machines too (the host dies)"
    )
    workers.set_defaults(func="nonomad.cli_platform:cmd_workers")


def add_deploy(
    sub: argparse._SubParsersAction[Parser],
    conn: Parser,
    out: Parser,
) -> None:
    """Add `deploy APP_TOML` to the top-level subparsers (the command is nonomad.cli_deploy)."""
    deploy = sub.add_parser(
        "deploy",
        parents=[conn, out],
        help="make an app's machines match its spec (TOML), with standbys",
        description=DEPLOY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    deploy.add_argument("app_toml", type=Path, metavar="APP_TOML", help="the app spec")
    deploy.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, and whether each region has room for it; change nothing",
    )
    deploy.add_argument(
        "--keep",
        action="store_true",
        help="when the deploy fails part way, keep the machines it created (default: destroy "
        "them again)",
    )
    deploy.add_argument(
        "--wait-timeout",
        type=float,
        default=60.0,
        help="seconds each wait for a machine's state may take (default 60)",
    )
    deploy.set_defaults(func="nonomad.cli_deploy:cmd_deploy")


WORKERS_DESCRIPTION = """\
The workers flaps knows, or a fault on one worker of the local cluster `nonomad up` runs:

  nonomad workers                     every worker: region, status, free capacity
  nonomad workers cordon ID           it takes no new machines; its machines keep running
  nonomad workers uncordon ID         it takes new machines again
  nonomad workers kill ID             SIGKILL its flyd (its machines run on: a daemon crash)
  nonomad workers kill ID --with-machines   its machines die too (the host died)
  nonomad workers pause ID            SIGSTOP its flyd (a hang); `resume ID` SIGCONTs it
  nonomad workers restart ID          start its flyd again on its data dir
  nonomad workers partition ID        cut its host off from every other (`up --hosts`)
  nonomad workers heal ID             join it again

A killed or paused worker's machines fail over to their standbys; when it comes back, its
machines whose standby took over stop and stand by in turn (docs/fencing.md).
"""

DEPLOY_DESCRIPTION = """\
Make an app's machines match its spec: create what is missing (each with a standby on another
worker of its region), replace changed machines one at a time gated by their checks (rolling
back on a failed check), destroy what the spec no longer asks for. Running it twice changes
nothing. The checks run on each machine's worker; the deploy waits for the worker to say the
machine serves (up to a check's grace_period + timeout) and never dials a machine itself.

  nonomad deploy app.toml             deploy, one line per step, then a table
  nonomad deploy app.toml --dry-run   the plan per slot, where flaps would place new machines
                                      and whether each region has room for all of them;
                                      changes nothing (exit 1 when a region has no room)
  nonomad deploy app.toml --json      the report (or the plan) as JSON

A region without room for everything the deploy would create there fails it before anything
changes. A deploy that fails part way destroys the machines it created (--keep keeps them)
and rolls back the machines it updated; the message says what it did.

Exit status: 0 done, 1 the deploy failed or was rolled back (the message says why), 2 the spec
is invalid (the message names the field).
"""


def add_image(sub: argparse._SubParsersAction[Parser], out: Parser) -> None:
    """Add `image build` and `image list` to the top-level subparsers."""
    image = sub.add_parser("image", help="build images for the workers")
    isub = image.add_subparsers(dest="image_command", required=True, metavar="COMMAND")
    build = isub.add_parser(
        "build",
        parents=[out],
        help="build DIR into an OCI image",
        epilog=BUILD_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument("dir", metavar="DIR", help="the files of the image")
    build.add_argument("--tag", required=True, metavar="NAME:TAG", help="the image's reference")
    build.add_argument("--app", metavar="APP", help="the app it is for: its owner")
    build.add_argument(
        "--share-with",
        type=app_list,
        action="extend",
        default=[],
        metavar="A,B",
        help="other apps that may run it (repeatable)",
    )
    build.add_argument("--public", action="store_true", help="every app may run it")
    build.add_argument("--entrypoint", metavar="CMD", help="what machines run")
    build.add_argument("--cmd", metavar="ARGS", help="arguments after the entrypoint")
    build.add_argument(
        "--port",
        type=port,
        action="append",
        default=[],
        metavar="PORT",
        help="a TCP port the command serves on: published by `machines run` when it names no "
        "--port, and the image's $PORT (repeatable; the first is $PORT)",
    )
    build.add_argument(
        "--env", type=env_pair, action="append", default=[], metavar="K=V", help="repeatable"
    )
    build.add_argument(
        "--workdir", help="working directory (absolute; default: the base's, else /)"
    )
    build.add_argument(
        "--base",
        type=Path,
        metavar="PATH",
        help="a base image under DIR: OCI layout, docker-save archive or rootfs tar",
    )
    build.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="image source directory to write to (default: the local cluster's, see below)",
    )
    build.set_defaults(func="nonomad.cli_image:cmd_build")
    listing = isub.add_parser(
        "list",
        parents=[out],
        help="the images of an image source, and who may run each",
        description="Every NAME:TAG of the image source (the local cluster's by default), its "
        "digest, and who may run it as its manifest records (docs/images.md): an image that "
        "records no owner and is not public runs for no app.",
    )
    listing.add_argument(
        "--source",
        type=Path,
        metavar="DIR",
        help="the image source directory (default: the local cluster's)",
    )
    listing.set_defaults(func="nonomad.cli_image:cmd_list")


# -- tokens and secrets ----------------------------------------------------------------------------


def duration(value: str) -> float:
    """`90s`, `30m`, `24h`, `7d` (or plain seconds) as seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (value[:-1], units[value[-1]]) if value[-1:] in units else (value, 1)
    try:
        seconds = float(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a duration like 90s, 30m, 24h, 7d"
        ) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value!r}")
    return seconds


def _limits(
    parser: argparse.ArgumentParser, *, apps_help: str, expires_help: str = "e.g. 24h, 7d"
) -> None:
    parser.add_argument("--app", action="append", default=[], metavar="APP", help=apps_help)
    parser.add_argument(
        "--ops",
        metavar="OPS",
        help="comma-separated operations: read, write (create update start stop signal "
        "destroy lease), deploy (read + write), admin (workers cordon regions), or *",
    )
    parser.add_argument("--expires", type=duration, metavar="DURATION", help=expires_help)
    parser.add_argument(
        "--machine", action="append", default=[], metavar="ID", help="only this machine"
    )


TOKENS_DESCRIPTION = """\
Tokens for flaps are macaroons: `create` mints one from the root keys with limits (caveats);
anyone holding a token can `attenuate` it, adding limits without the root keys. flaps accepts
a token signed by any key in its keys file, so keys rotate without downtime: `keygen` puts a
new key first (it mints from then on), `retire` drops an old one (its tokens stop working).
Every token expires (30 days after it was minted unless --expires says otherwise); `revoke`
ends one before then, by its id, in the revocation list beside the keys, which flaps reads
again within a second (the proxy, which asks flaps about tokens, within its token cache's
few seconds). Fleet operations (workers, regions, cordon, placement watches) take an
operator token: --all-apps, no --app or --machine.
The local cluster's keys are STATE_DIR/token-keys; its admin token is STATE_DIR/admin.token.

  nonomad tokens create --app web --ops deploy --expires 7d > web.token
  nonomad tokens attenuate --token-file web.token --ops read --expires 1h
  nonomad tokens show --token-file web.token
  nonomad tokens revoke 3f2a9c0e1b7d4a65
"""


def add_tokens(sub: argparse._SubParsersAction[Parser], out: Parser) -> None:
    """Add `tokens create|attenuate|show|keygen|retire|revoke` (the commands:
    nonomad.cli_tokens)."""
    tokens = sub.add_parser(
        "tokens",
        help="mint, narrow and read tokens for flaps; rotate their root keys",
        description=TOKENS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = tokens.add_subparsers(dest="tokens_command", required=True, metavar="COMMAND")
    keys = Parser(add_help=False)
    keys.add_argument(
        "--keys", type=Path, metavar="FILE", help="root keys (default: the local cluster's)"
    )
    held = Parser(add_help=False)
    held.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="the token (default: $NONOMAD_TOKEN, else the local cluster's admin token)",
    )
    create = tsub.add_parser("create", parents=[keys, out], help="mint a token")
    _limits(
        create,
        apps_help="an app it may touch (repeatable); --all-apps for any",
        expires_help="how long it lasts, e.g. 24h, 7d (default 30d)",
    )
    create.add_argument("--all-apps", action="store_true", help="any app")
    create.add_argument("--key-id", metavar="ID", help="mint with this key, not the first")
    create.set_defaults(func="nonomad.cli_tokens:cmd_create")
    narrow = tsub.add_parser(
        "attenuate", parents=[held, out], help="a narrower token from one you hold"
    )
    _limits(narrow, apps_help="only this app (repeatable)")
    narrow.set_defaults(func="nonomad.cli_tokens:cmd_attenuate")
    show = tsub.add_parser("show", parents=[held, out], help="a token's id, key and caveats")
    show.set_defaults(func="nonomad.cli_tokens:cmd_show")
    keygen = tsub.add_parser("keygen", parents=[keys], help="add a new root key, first")
    keygen.add_argument("--key-id", metavar="ID", help="its id (default k<n>)")
    keygen.set_defaults(func="nonomad.cli_tokens:cmd_keygen")
    retire = tsub.add_parser("retire", parents=[keys], help="drop a root key")
    retire.add_argument("key_id", metavar="KEY_ID")
    retire.set_defaults(func="nonomad.cli_tokens:cmd_retire")
    revoke = tsub.add_parser(
        "revoke", parents=[keys], help="stop honouring a token, by its id (`tokens show`)"
    )
    revoke.add_argument("token_id", metavar="TOKEN_ID")
    revoke.add_argument(
        "--revoked",
        type=Path,
        metavar="FILE",
        help="the revocation list (default: revoked-tokens beside the keys)",
    )
    revoke.add_argument("--note", default="", help="why, kept beside the id")
    revoke.set_defaults(func="nonomad.cli_tokens:cmd_revoke")


SECRETS_DESCRIPTION = """\
An app's secrets are environment variables of its machines whose values reach the machines
and nowhere else: flaps and every read show names only, and each worker keeps the values
encrypted. `set` and `unset` update every machine the app has now (its standbys too), so each
started machine restarts with them, as `fly secrets set` redeploys.

Unlike `fly secrets`, there is no store of the app's own: the values live on its machines.
An app with no machines cannot be given secrets (create one with `nonomad machines run APP
... --secret NAME=VALUE`), and a machine made later has only what it is given: `nonomad
deploy` copies them from one of the app's machines, a plain `machines run` gets none.

  nonomad secrets set web DATABASE_URL=postgres://... API_KEY=...
  nonomad secrets list web
  nonomad secrets unset web API_KEY
"""


def add_secrets(sub: argparse._SubParsersAction[Parser], conn: Parser, out: Parser) -> None:
    """Add `secrets set|unset|list` (the commands: nonomad.cli_secrets)."""
    secrets = sub.add_parser(
        "secrets",
        help="set, unset and list an app's secrets",
        description=SECRETS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = secrets.add_subparsers(dest="secrets_command", required=True, metavar="COMMAND")
    put = ssub.add_parser("set", parents=[conn, out], help="set secrets on every machine")
    put.add_argument("app", metavar="APP")
    put.add_argument("pairs", type=env_pair, nargs="+", metavar="NAME=VALUE")
    put.set_defaults(func="nonomad.cli_secrets:cmd_set")
    unset = ssub.add_parser("unset", parents=[conn, out], help="remove secrets")
    unset.add_argument("app", metavar="APP")
    unset.add_argument("names", nargs="+", metavar="NAME")
    unset.set_defaults(func="nonomad.cli_secrets:cmd_unset")
    listed = ssub.add_parser("list", parents=[conn, out], help="the names, per machine")
    listed.add_argument("app", metavar="APP")
    listed.set_defaults(func="nonomad.cli_secrets:cmd_list")
