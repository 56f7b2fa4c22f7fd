"""A cluster's secrets on disk: its CA and certificates, token root keys and an admin token.

`provision(directory, parts)` makes what is missing and reuses what is there (so tokens and
certificates stay valid across restarts of `nonomad up`); every file is mode 0600. Then
`flaps_args()`, `worker_args(worker_id)`, ... are the flags that make each service serve
mutual TLS with its own certificate, check tokens, and call the others over the cluster's TLS:

    tls/ca.pem, tls/ca.key        the cluster CA (runtime.pki)
    tls/<part>.pem, tls/<part>.key  one certificate per part (flaps, proxy, flyd-ams-1, cli),
                                  each naming its role (runtime.pki.part_role)
    token-keys                    token root keys (model.tokens), the first mints
    revoked-tokens                ids of revoked tokens (`nonomad tokens revoke`), if any
    admin.token                   an operator token that may do everything
    console.token                 a read-only token for the web console (read, workers, regions)

A certificate that names no role or another one (made before roles were) is issued again, and
a token that expires within RENEW_WITHIN (or has expired, or never does, or was revoked) is
minted again: `nonomad up` keeps them all usable.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from model.tokens import (
    DEFAULT_TTL,
    REVOKED_FILE,
    InvalidToken,
    Keyring,
    caveats,
    new_key_line,
    parse_revoked,
    read_token,
)
from runtime.pki import WORKER_PREFIX, CertPaths, ClusterCA, part_role, write_private
from runtime.tracing import CLUSTER_NAME, ChannelTLS

__all__ = ["CLI_PART", "CONSOLE_PART", "RENEW_WITHIN", "ClusterSecurity", "provision"]

CLI_PART = "cli"
"""The certificate of the operator's CLI (`nonomad status` asks workers directly)."""
CONSOLE_PART = "console"
CONSOLE_OPS = ("read", "workers", "regions")
"""What the console's token allows, on every app: reading, nothing else."""
RENEW_WITHIN = DEFAULT_TTL / 3
"""A local token with less than this left is minted again by `provision` (`nonomad up`)."""


@dataclass(frozen=True)
class ClusterSecurity:
    """Where one cluster's CA, certificates, root keys and admin token are."""

    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "tls" / "ca.pem"

    @property
    def token_keys(self) -> Path:
        return self.root / "token-keys"

    @property
    def admin_token(self) -> Path:
        return self.root / "admin.token"

    @property
    def console_token(self) -> Path:
        return self.root / "console.token"

    @property
    def revoked_tokens(self) -> Path:
        """Beside the root keys, where flaps looks for it by default."""
        return self.token_keys.with_name(REVOKED_FILE)

    def revoked(self) -> frozenset[str]:
        """The ids of the tokens revoked here (none without the file)."""
        path = self.revoked_tokens
        return parse_revoked(path.read_text(), str(path)) if path.exists() else frozenset()

    def cert(self, part: str) -> CertPaths:
        tls = self.root / "tls"
        return CertPaths(tls / f"{part}.pem", tls / f"{part}.key")

    def keyring(self) -> Keyring:
        return Keyring.load(self.token_keys)

    def client_tls(self) -> ChannelTLS:
        """How a client (CLI, SDK) verifies flaps: the CA, no certificate of its own."""
        return ChannelTLS(ca=self.ca)

    def member_tls(self, part: str = CLI_PART) -> ChannelTLS:
        """How `part` reaches a worker, a proxy or flaps' cluster port: mutual TLS."""
        cert = self.cert(part)
        return ChannelTLS(ca=self.ca, cert=cert.cert, key=cert.key, server_name=CLUSTER_NAME)

    def _serve(self, part: str, *, mutual: bool) -> list[str]:
        cert = self.cert(part)
        args = ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]
        if mutual:
            args += ["--tls-client-ca", str(self.ca)]
        return [*args, "--cluster-ca", str(self.ca)]

    def worker_args(self, worker_id: str) -> list[str]:
        """flyd of worker `worker_id`: serves the cluster's certificates only, announces over
        mutual TLS, with the certificate named for it (`flyd-<worker id>`, made now if there
        is none: the CA is here)."""
        part = f"{WORKER_PREFIX}{worker_id}"
        ClusterCA.ensure(self.ca.parent).issue(part, part_role(part))
        return self._serve(part, mutual=True)

    def flaps_args(self, cluster_listen: str = "127.0.0.1:0") -> list[str]:
        """flaps: TLS and tokens on its listen port, the cluster's parts on `cluster_listen`."""
        return [
            *self._serve("flaps", mutual=False),
            "--cluster-listen",
            cluster_listen,
            "--token-keys",
            str(self.token_keys),
        ]

    def proxy_args(self) -> list[str]:
        """The proxy: its gRPC (admin, registry) for the cluster's certificates only. It holds
        no token keys: flaps verifies the tokens of pinned requests for it (proxy.pins)."""
        return self._serve("proxy", mutual=True)

    def registry_args(self) -> list[str]:
        return self._serve("registry", mutual=True)

    def console_args(self) -> list[str]:
        """The console: its certificate for the cluster's parts (flaps' replica, the proxy),
        the CA to check flaps with, and its read-only token."""
        cert = self.cert(CONSOLE_PART)
        return [
            "--tls-cert",
            str(cert.cert),
            "--tls-key",
            str(cert.key),
            "--cluster-ca",
            str(self.ca),
            "--token-file",
            str(self.console_token),
        ]


def provision(
    directory: Path, parts: Iterable[str], *, now: float | None = None
) -> ClusterSecurity:
    """The cluster's security in `directory`, with a certificate for each of `parts` (and the
    CLI's), each in its role (`runtime.pki.part_role`), an admin token and the console's
    read-only one: made where missing, made again where stale (a certificate without its
    role, a token near its expiry at `now`), reused where present."""
    security = ClusterSecurity(directory)
    ca = ClusterCA.ensure(directory / "tls")
    for part in dict.fromkeys([*parts, CLI_PART]):
        ca.issue(part, part_role(part))
    if not security.token_keys.exists():
        write_private(security.token_keys, f"{new_key_line('k1')}\n".encode())
    keyring = security.keyring()
    revoked = security.revoked()
    at = time.time() if now is None else now
    tokens = [(security.admin_token, ("*",)), (security.console_token, CONSOLE_OPS)]
    for path, ops in tokens:
        try:
            grant = keyring.verify(read_token(path), now=at)
            fresh = grant.token_id not in revoked and grant.expires - at > RENEW_WITHIN
        except (OSError, InvalidToken):  # none yet, its key rotated away, or it expired
            fresh = False
        if not fresh:
            token = keyring.mint(caveats(apps=["*"], ops=list(ops)), now=at)
            write_private(path, f"{token}\n".encode())
    return security
