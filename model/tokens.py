"""Tokens for the Machines and Platform APIs: macaroons (pymacaroons), as Fly issues them.

A token is minted from a root key and carries caveats, conditions that must all hold for a
call it authorizes (`nonomad tokens create`):

    apps = web,api          only these apps (`apps = *`: any)
    ops = read,write        only these operations (below)
    expires = 1767225600    not at or after this Unix time
    machines = ams-1-3f0..  only these machines

Whoever holds a token can add caveats without the root key (`nonomad tokens attenuate`): each
one narrows what it allows, since all of them must hold, and none can be taken off without
breaking the signature. The operations, and the groups that name several:

    read                     GetMachine, ListMachines, WaitMachine, ListMachineEvents, logs
    write   = create update start stop signal destroy lease
    deploy  = read + write   what `nonomad deploy` does to an app
    admin   = workers cordon regions                 the fleet, not an app
    *                        everything

Fleet operations are no app's: ListRegions, ListWorkers, CordonWorker (the workers, their
capacity, taking one out of placement) and WatchPlacements (every app's decisions as they are
made). They need an **operator token**: one that no caveat narrows to some apps or machines
(no `apps` caveat, or only `apps = *`; no `machines` caveat), whatever its `ops` say. So a
token for app `evil`, even with `ops = *`, never lists or cordons workers (`Grant.check` with
`fleet=True`); its ops still say which fleet operations an operator token may do (the
console's: read, workers, regions). An app asks whether its machines fit with
SimulatePlacement, which is the app's.

Every token expires: `mint` adds `expires` (DEFAULT_TTL from now) unless the caveats set
one, and `verify` refuses a token with none (one minted before expiries were required). A
token is revoked by its id (`nonomad tokens revoke ID`, a line of the revocation list beside
the root keys: `parse_revoked`), which flaps reads again when it changes.

The identifier names the root key (`nonomad1 <key id> <token id>`), so several keys are
accepted at once while they rotate (`Keyring`), and a token has an id to log in its place.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pymacaroons import Macaroon, Verifier
from pymacaroons.exceptions import MacaroonException

__all__ = [
    "ALL_OPS",
    "DEFAULT_TTL",
    "GROUPS",
    "REVOKED_FILE",
    "Caveat",
    "Denied",
    "Grant",
    "InvalidToken",
    "Keyring",
    "KeysError",
    "TokenInfo",
    "attenuate",
    "caveats",
    "expand_ops",
    "inspect",
    "new_key_line",
    "parse_revoked",
    "read_token",
]

LOCATION = "nonomad"
_ID_PREFIX = "nonomad1"
WRITE_OPS = ("create", "update", "start", "stop", "signal", "destroy", "lease")
ADMIN_OPS = ("workers", "cordon", "regions")
ALL_OPS = ("read", *WRITE_OPS, *ADMIN_OPS)
GROUPS: Mapping[str, tuple[str, ...]] = {
    "write": WRITE_OPS,
    "deploy": ("read", *WRITE_OPS),
    "admin": ADMIN_OPS,
    "*": ALL_OPS,
}
VERIFIED_KEEP = 10_000  # tokens a keyring remembers having verified
REVOKED_FILE = "revoked-tokens"
"""The revocation list's name, beside the root keys file."""
DEFAULT_TTL = 30 * 86400
"""How long a minted token lasts when its caveats do not say (`nonomad tokens create
--expires`)."""
_KEY_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_TOKEN_ID = re.compile(r"[0-9a-f]{16}")
_MIN_KEY_BYTES = 32


class InvalidToken(Exception):
    """The token is missing, malformed, signed by no key we hold, or expired: UNAUTHENTICATED."""


class Denied(Exception):
    """A valid token whose caveat `caveat` does not allow the call: PERMISSION_DENIED."""

    def __init__(self, caveat: Caveat, what: str) -> None:
        super().__init__(f'token caveat "{caveat.text}" does not allow {what}')
        self.caveat = caveat
        self.what = what


class KeysError(ValueError):
    """The root keys file is unusable; the message says why (never with a key in it)."""


# -- caveats -----------------------------------------------------------------------------------


def expand_ops(names: Iterable[str]) -> frozenset[str]:
    """Operation names with groups spelled out; ValueError naming an unknown one."""
    out: set[str] = set()
    for name in names:
        if name in GROUPS:
            out.update(GROUPS[name])
        elif name in ALL_OPS:
            out.add(name)
        else:
            known = ", ".join([*ALL_OPS, *GROUPS])
            raise ValueError(f"unknown operation {name!r} (known: {known})")
    return frozenset(out)


@dataclass(frozen=True)
class Caveat:
    """One condition of a token: `key = value` as written in the macaroon (`text`), its items
    (`values`; for `ops`, with the groups spelled out) or, for `expires`, the time."""

    key: str
    values: frozenset[str]
    text: str
    expires: int = 0

    @classmethod
    def parse(cls, text: str) -> Caveat:
        """ValueError naming what is wrong with a caveat this flaps does not understand."""
        key, sep, value = text.partition(" = ")
        if not sep or not value:
            raise ValueError(f'caveat "{text}" is not "key = value"')
        if key == "expires":
            if not value.isdigit():
                raise ValueError(f'caveat "{text}": expires is a Unix time in seconds')
            return cls(key, frozenset(), text, expires=int(value))
        values = frozenset(value.split(","))
        if "" in values:
            raise ValueError(f'caveat "{text}" has an empty item')
        if key == "ops":
            values = expand_ops(values)  # checked against operations, so kept spelled out
        elif key not in ("apps", "machines"):
            raise ValueError(f'caveat "{text}": unknown key {key!r}')
        return cls(key, values, text)


def caveats(
    *,
    apps: Sequence[str] = (),
    ops: Sequence[str] = (),
    expires: float | None = None,
    machines: Sequence[str] = (),
) -> list[str]:
    """The caveats for these limits (empty ones add nothing), checked as flaps checks them."""
    out = []
    if apps:
        out.append(f"apps = {','.join(apps)}")
    if ops:
        expand_ops(ops)
        out.append(f"ops = {','.join(ops)}")
    if expires is not None:
        out.append(f"expires = {int(expires)}")
    if machines:
        out.append(f"machines = {','.join(machines)}")
    for text in out:
        Caveat.parse(text)
    return out


# -- what a verified token allows ----------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """What a verified token allows: every caveat must hold. `token_id` names it in logs."""

    token_id: str
    caveats: tuple[Caveat, ...]

    @property
    def limits_apps(self) -> bool:
        return any(c.key == "apps" and "*" not in c.values for c in self.caveats)

    @property
    def expires(self) -> int:
        """The Unix time it expires at (the earliest `expires` caveat); 0: it names none."""
        return min((c.expires for c in self.caveats if c.key == "expires"), default=0)

    def check(
        self,
        ops: Iterable[str],
        app: str | None = None,
        machine: str | None = None,
        *,
        fleet: bool = False,
    ) -> None:
        """Raise Denied, naming the first caveat that does not hold, unless the token allows
        each of `ops` on `app` (when the call is about one) and `machine` (when it names one).
        An operation that creates a machine (`create`) is refused by any `machines` caveat;
        a fleet operation (`fleet`) by any caveat that narrows the token to some apps or
        machines: it takes an operator token."""
        for op in ops:
            for c in self.caveats:
                if c.key == "ops" and op not in c.values:
                    raise Denied(c, f"operation {op}")
                if c.key == "machines" and op == "create":
                    raise Denied(c, "creating machines")
        for c in self.caveats:
            if fleet and (c.key == "machines" or (c.key == "apps" and "*" not in c.values)):
                raise Denied(c, "fleet operations: they take an operator token (no apps caveat)")
        for c in self.caveats:
            if c.key == "apps" and app is not None and "*" not in c.values and app not in c.values:
                raise Denied(c, f"app {app}")
            if c.key == "machines" and machine is not None and machine not in c.values:
                raise Denied(c, f"machine {machine}")

    def may(self, op: str, app: str, machine: str) -> bool:
        """Whether `op` on this machine of `app` is allowed (for filtering lists)."""
        try:
            self.check((op,), app, machine)
        except Denied:
            return False
        return True


# -- keys ----------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def new_key_line(key_id: str) -> str:
    """A keys-file line with a fresh random root key: `<key id> <key, base64url>`."""
    if not _KEY_ID.fullmatch(key_id):
        raise KeysError(f"key id {key_id!r}: use 1-32 of a-z, 0-9 and -, starting alnum")
    return f"{key_id} {_b64(secrets.token_bytes(_MIN_KEY_BYTES))}"


class Keyring:
    """Root keys by id. The first is the one new tokens are minted with; every one verifies.

    Rotation without downtime: put a new key first (every flaps accepts both once it has
    re-read the file), mint with it, and drop the old key when its tokens should stop working.
    """

    def __init__(self, keys: Sequence[tuple[str, bytes]]) -> None:
        if not keys:
            raise KeysError("no keys")
        self._keys = dict(keys)
        if len(self._keys) != len(keys):
            raise KeysError("a key id appears twice")
        self.current = keys[0][0]
        # Tokens whose signature these keys verified, by SHA-256: (id, caveats). A rotation
        # makes a new Keyring, and so starts this afresh.
        self._verified: dict[str, Grant] = {}

    @property
    def ids(self) -> list[str]:
        return list(self._keys)

    @classmethod
    def parse(cls, text: str, where: str = "keys") -> Keyring:
        """Lines of `<key id> <key, base64url>`; blank lines and `#` comments are skipped."""
        keys = []
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not _KEY_ID.fullmatch(parts[0]):
                raise KeysError(f"{where} line {n}: expected `<key id> <key>`")
            try:
                key = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
            except (binascii.Error, ValueError):
                raise KeysError(f"{where} line {n}: the key is not base64url") from None
            if len(key) < _MIN_KEY_BYTES:
                raise KeysError(f"{where} line {n}: a key needs {_MIN_KEY_BYTES} bytes or more")
            keys.append((parts[0], key))
        if not keys:
            raise KeysError(f"{where}: no keys")
        try:
            return cls(keys)
        except KeysError as err:
            raise KeysError(f"{where}: {err}") from None

    @classmethod
    def load(cls, path: Path) -> Keyring:
        """The keys in `path`, which only its owner may read (mode 0600 or stricter)."""
        try:
            mode = path.stat().st_mode
            text = path.read_text()
        except OSError as err:
            raise KeysError(f"{path}: {err.strerror or err}") from None
        if mode & 0o077:
            raise KeysError(f"{path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
        return cls.parse(text, str(path))

    def mint(
        self,
        caveat_texts: Iterable[str],
        *,
        key_id: str | None = None,
        ttl: float = DEFAULT_TTL,
        now: float | None = None,
    ) -> str:
        """A new token signed with the current key (or `key_id`), with these caveats, and one
        that it expires `ttl` seconds from `now` when none of them says when."""
        kid = key_id or self.current
        if kid not in self._keys:
            raise KeysError(f"no key {kid!r}")
        texts = list(caveat_texts)
        parsed = [Caveat.parse(text) for text in texts]
        if not any(c.key == "expires" for c in parsed):
            texts.append(f"expires = {int((time.time() if now is None else now) + ttl)}")
        token_id = secrets.token_hex(8)
        macaroon = Macaroon(
            location=LOCATION, identifier=f"{_ID_PREFIX} {kid} {token_id}", key=self._keys[kid]
        )
        for text in texts:
            macaroon.add_first_party_caveat(text)
        return str(macaroon.serialize())

    def verify(self, token: str, now: float | None = None) -> Grant:
        """The token's grant; InvalidToken when it is malformed, signed by no key held here
        (or tampered with: any change breaks the signature), expired, or never expires (a
        token minted before every token had to).

        The signature is checked, and compared in constant time (pymacaroons uses
        hmac.compare_digest), the first time these keys see the token; then it is known by its
        text, and only its expiry is checked again (the text is held as the keys are: whoever
        reads this memory holds the keys too; a SHA-256 as the key cost a call more than the
        rest of its check, measured in `python -m bench --only auth`). A caller's request is
        checked against its caveats every time (`Grant.check`).
        """
        token = token.strip()
        grant = self._verified.get(token)
        if grant is None:
            grant = self._verify(token)
            if len(self._verified) >= VERIFIED_KEEP:
                self._verified.clear()
            self._verified[token] = grant
        expires = grant.expires
        if not expires:
            raise InvalidToken(
                f"token {grant.token_id} never expires: every token must; mint a new one "
                "(`nonomad tokens create`)"
            )
        if (time.time() if now is None else now) >= expires:
            raise InvalidToken(f"token {grant.token_id} expired at {_utc(expires)}")
        return grant

    def _verify(self, token: str) -> Grant:
        macaroon, key_id, token_id = _open(token)
        key = self._keys.get(key_id)
        if key is None:
            raise InvalidToken(f"token {token_id} is signed with a key this flaps does not hold")
        verifier = Verifier()
        # Every first-party caveat counts towards the signature here; what each means is
        # checked below, on the request.
        verifier.satisfy_general(lambda _predicate: True)
        try:
            verifier.verify(macaroon, key)
        except MacaroonException:
            raise InvalidToken(f"token {token_id} has a bad signature") from None
        parsed = []
        for caveat in macaroon.caveats:
            if not caveat.first_party():
                raise InvalidToken(f"token {token_id} has a third-party caveat")
            try:
                parsed.append(Caveat.parse(caveat.caveat_id))
            except ValueError as err:
                raise InvalidToken(f"token {token_id}: {err}") from None
        return Grant(token_id, tuple(parsed))


def _utc(seconds: int) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _open(token: str) -> tuple[Macaroon, str, str]:
    """Deserialize a token: (macaroon, key id, token id); InvalidToken if it is not ours."""
    try:
        macaroon = Macaroon.deserialize(token.strip())
        identifier = macaroon.identifier
    except (MacaroonException, ValueError, TypeError, IndexError, binascii.Error):
        raise InvalidToken("not a nonomad token") from None
    parts = identifier.split(" ") if isinstance(identifier, str) else []
    if len(parts) != 3 or parts[0] != _ID_PREFIX or macaroon.location != LOCATION:
        raise InvalidToken("not a nonomad token")
    return macaroon, parts[1], parts[2]


def attenuate(token: str, caveat_texts: Iterable[str]) -> str:
    """The token with more caveats: it allows at most what it did. No root key is needed."""
    macaroon, _, _ = _open(token)
    for text in caveat_texts:
        Caveat.parse(text)
        macaroon.add_first_party_caveat(text)
    return str(macaroon.serialize())


@dataclass(frozen=True)
class TokenInfo:
    """What a token says about itself, read without verifying it."""

    token_id: str
    key_id: str
    caveats: tuple[str, ...]


def inspect(token: str) -> TokenInfo:
    """The token's id, key id and caveats (not verified: anyone can read them)."""
    macaroon, key_id, token_id = _open(token)
    return TokenInfo(token_id, key_id, tuple(c.caveat_id for c in macaroon.caveats))


def parse_revoked(text: str, where: str = "revoked tokens") -> frozenset[str]:
    """The token ids of a revocation list: one a line, then anything after a `#` (when it was
    revoked, and why); blank lines are skipped. ValueError naming the line of a bad id."""
    ids = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        if not _TOKEN_ID.fullmatch(line):
            raise ValueError(f"{where} line {n}: {line[:40]!r} is not a token id (16 hex digits)")
        ids.add(line)
    return frozenset(ids)


def read_token(path: Path) -> str:
    """A token from a file (its first non-blank line)."""
    for line in path.read_text().splitlines():
        if line.strip():
            return line.strip()
    raise InvalidToken(f"{path} holds no token")
