"""Machine secrets: sealed with this worker's own key the moment they arrive, opened only to
put them in a machine's environment.

A create or update carries a secret's value in `config.secrets`. The worker seals it
(AES-256-GCM, bound to the machine id and the name) into the machine's row, where it stays
encrypted in LMDB, and puts the name with the value `REDACTED` in the config it keeps. So
every machine the worker hands out, to a caller, its event stream, the registry and so to
flaps and the proxy, has only names. The key is a file of the worker's data directory
(`secrets.key`, mode 0600), made on first start; without it the sealed values cannot be
opened again.
"""

from __future__ import annotations

import base64
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from flyd.v1 import machine_pb2 as pb
from model.errors import InvalidArgument
from model.validate import REDACTED

__all__ = ["REDACTED", "SecretBox", "SecretsUnreadable"]

_NONCE = 12


class SecretsUnreadable(Exception):
    """A sealed secret does not open with this worker's key (the key file was replaced)."""


class SecretBox:
    """Seals and opens machine secrets with one worker's key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @classmethod
    def ephemeral(cls) -> SecretBox:
        """A box with a key of its own that is never stored (tests, fakes)."""
        return cls(AESGCM.generate_key(bit_length=256))

    @classmethod
    def load(cls, path: Path) -> SecretBox:
        """The worker's key in `path`, made (readable by its owner only) if it is missing."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            key = path.read_bytes()
            if len(key) != 32:
                raise ValueError(f"{path}: a secrets key is 32 bytes, this is {len(key)}") from None
            return cls(key)
        key = AESGCM.generate_key(bit_length=256)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        return cls(key)

    def seal(self, machine_id: str, name: str, value: str) -> str:
        nonce = secrets.token_bytes(_NONCE)
        sealed = self._aead.encrypt(nonce, value.encode(), _aad(machine_id, name))
        return base64.b64encode(nonce + sealed).decode()

    def open(self, machine_id: str, name: str, sealed: str) -> str:
        raw = base64.b64decode(sealed)
        try:
            return self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], _aad(machine_id, name)).decode()
        except InvalidTag:
            raise SecretsUnreadable(
                f"secret {name} of machine {machine_id} does not open with this worker's key"
            ) from None

    def open_all(self, machine_id: str, sealed: Mapping[str, str]) -> dict[str, str]:
        return {name: self.open(machine_id, name, box) for name, box in sealed.items()}

    def take(
        self,
        machine_id: str,
        config: pb.MachineConfig,
        current: Mapping[str, str] | None = None,
        field: str = "config",
    ) -> tuple[pb.MachineConfig, dict[str, str]]:
        """Split a config as it arrived into the config to keep (each secret `REDACTED`) and
        the sealed secrets. With `current` (an update: the machine's sealed secrets), a value
        of `REDACTED` keeps the current one."""
        kept = pb.MachineConfig()
        kept.CopyFrom(config)
        sealed: dict[str, str] = {}
        for name, value in config.secrets.items():
            if value == REDACTED:
                if current is None or name not in current:
                    raise InvalidArgument(
                        f"{field}.secrets[{name}]",
                        f"{REDACTED} keeps a secret's value, and the machine has no {name}",
                    )
                sealed[name] = current[name]
            else:
                sealed[name] = self.seal(machine_id, name, value)
            kept.secrets[name] = REDACTED
        return kept, sealed

    def same(self, machine_id: str, sealed: Mapping[str, str], config: pb.MachineConfig) -> bool:
        """Whether `config`'s secrets (as a create sends them) are the sealed ones: a retried
        create. Compared in constant time."""
        if set(sealed) != set(config.secrets):
            return False
        opened = self.open_all(machine_id, sealed)
        return all(
            hmac.compare_digest(opened[name].encode(), config.secrets[name].encode())
            for name in sealed
        )


def _aad(machine_id: str, name: str) -> bytes:
    # Bound to the machine and the name: a sealed value moved to another row does not open.
    return f"{machine_id}\0{name}".encode()
