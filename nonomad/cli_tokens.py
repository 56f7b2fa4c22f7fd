"""`nonomad tokens`: mint, narrow, read and revoke tokens for flaps; rotate their root keys.

A token goes to stdout alone on a line (`> file` keeps it), or in `--json` with its id and
caveats. Keys files are written mode 0600, the new key first: flaps re-reads the file, so a
rotation is `keygen`, hand out new tokens, then `retire` the old key. A minted token expires
(model.tokens.DEFAULT_TTL unless --expires); `revoke` adds a token's id to the revocation
list beside the keys, which flaps re-reads too.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

from model.tokens import (
    GROUPS,
    REVOKED_FILE,
    InvalidToken,
    Keyring,
    KeysError,
    attenuate,
    caveats,
    inspect,
    new_key_line,
    parse_revoked,
    read_token,
)
from nonomad.cli_common import TOKEN_ENV, CliError, UsageError, emit, key_values, state_dir
from nonomad.security import ClusterSecurity
from runtime.pki import write_private


def _keys_path(args: argparse.Namespace) -> Path:
    return args.keys or ClusterSecurity(state_dir(args)).token_keys


def _keyring(args: argparse.Namespace) -> Keyring:
    path = _keys_path(args)
    if not path.exists():
        hint = "" if args.keys else " (start one with `nonomad up`, or pass --keys FILE)"
        raise UsageError(f"no keys file {path}{hint}")
    try:
        return Keyring.load(path)
    except KeysError as err:
        raise CliError(str(err)) from None


def _held(args: argparse.Namespace) -> str:
    """The token the command works on: --token-file, $NONOMAD_TOKEN, the local admin token."""
    try:
        if args.token_file is not None:
            return read_token(args.token_file)
        if os.environ.get(TOKEN_ENV, "").strip():
            return os.environ[TOKEN_ENV].strip()
        admin = ClusterSecurity(state_dir(args)).admin_token
        if admin.exists():
            return read_token(admin)
    except (OSError, InvalidToken) as err:
        raise UsageError(f"cannot read the token: {err}") from None
    raise UsageError(f"which token? pass --token-file FILE or set ${TOKEN_ENV}")


def _caveats(args: argparse.Namespace, apps: list[str]) -> list[str]:
    ops = [op.strip() for op in args.ops.split(",") if op.strip()] if args.ops else []
    expires = time.time() + args.expires if args.expires else None
    try:
        return caveats(apps=apps, ops=ops, expires=expires, machines=args.machine)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _print(args: argparse.Namespace, token: str) -> None:
    info = inspect(token)
    emit(
        args,
        {"token": token, "token_id": info.token_id, "caveats": list(info.caveats)},
        lambda: token,
    )


def cmd_create(args: argparse.Namespace) -> int:
    if bool(args.app) == bool(args.all_apps):
        raise UsageError("say which apps: --app APP (repeatable) or --all-apps")
    texts = _caveats(args, ["*"] if args.all_apps else args.app)
    if not args.ops:
        texts.append("ops = read")  # least privilege unless asked
    try:
        token = _keyring(args).mint(texts, key_id=args.key_id)
    except KeysError as err:
        raise UsageError(f"--key-id: {err}") from None
    _print(args, token)
    return 0


def cmd_attenuate(args: argparse.Namespace) -> int:
    texts = _caveats(args, args.app)
    if not texts:
        raise UsageError("nothing to add: give --app, --ops, --expires or --machine")
    try:
        token = attenuate(_held(args), texts)
    except InvalidToken as err:
        raise UsageError(str(err)) from None
    _print(args, token)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    try:
        info = inspect(_held(args))
    except InvalidToken as err:
        raise UsageError(str(err)) from None
    report = {"token_id": info.token_id, "key_id": info.key_id, "caveats": list(info.caveats)}
    groups = ", ".join(f"{name} = {' '.join(ops)}" for name, ops in GROUPS.items() if name != "*")

    def human() -> str:
        lines = [("token", info.token_id), ("key", info.key_id)]
        lines += [("caveat", text) for text in info.caveats] or [("caveats", "none: anything")]
        return f"{key_values(lines)}\n(ops groups: {groups})"

    emit(args, report, human)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    path = _keys_path(args)
    lines = path.read_text().splitlines() if path.exists() else []
    ids = _keyring(args).ids if lines else []
    key_id = args.key_id or next(f"k{n}" for n in range(1, len(ids) + 2) if f"k{n}" not in ids)
    if key_id in ids:
        raise UsageError(f"--key-id: {key_id} is already in {path}")
    try:
        line = new_key_line(key_id)
    except KeysError as err:
        raise UsageError(f"--key-id: {err}") from None
    write_private(path, "".join(f"{x}\n" for x in [line, *lines]).encode())
    print(
        f"{key_id} now mints new tokens; every key in {path} verifies ({', '.join([key_id, *ids])})"
    )
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    path = args.revoked or _keys_path(args).with_name(REVOKED_FILE)
    text = path.read_text() if path.exists() else ""
    try:
        known = parse_revoked(text, str(path))
        parse_revoked(args.token_id, "TOKEN_ID")
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.token_id in known:
        print(f"token {args.token_id} is already revoked in {path}")
        return 0
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    note = " ".join(args.note.split())  # one line, whatever was passed
    line = f"{args.token_id}  # revoked {when}{f': {note}' if note else ''}\n"
    write_private(path, (text + ("\n" if text and not text.endswith("\n") else "") + line).encode())
    print(f"token {args.token_id} revoked: flaps refuses it once it re-reads {path}")
    return 0


def cmd_retire(args: argparse.Namespace) -> int:
    path = _keys_path(args)
    keyring = _keyring(args)
    if args.key_id not in keyring.ids:
        raise UsageError(f"no key {args.key_id} in {path} (it has {', '.join(keyring.ids)})")
    if keyring.ids == [args.key_id]:
        raise UsageError(f"{args.key_id} is the only key: add one first (`nonomad tokens keygen`)")
    kept = [line for line in path.read_text().splitlines() if line.split()[:1] != [args.key_id]]
    write_private(path, "".join(f"{line}\n" for line in kept).encode())
    print(f"{args.key_id} retired: tokens it signed stop working once flaps re-reads {path}")
    return 0
