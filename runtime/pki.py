"""The cluster's certificates: one CA, and a certificate per part, made with `cryptography`.

Every part of a cluster (flaps, proxy, registry, each flyd, an operator's CLI) holds a
certificate the cluster CA signed. It serves TLS with it and presents it as a client when it
calls another part, which accepts the call only because that CA signed it (mutual TLS). Every
certificate names `CLUSTER_NAME`, and parts check that name rather than the address they
dialled (`ChannelTLS(server_name=CLUSTER_NAME)`), so workers on any host, reached by any
address, verify without a certificate per address. It also names `localhost`, `127.0.0.1` and
`::1` (and any `hosts` given), so grpcurl and the CLI verify a local flaps with only `-cacert`.

Every certificate also names its part's role (`ROLES`), as its subject's organizational unit,
and its common name says which one it is: `flyd-<worker id>` for a worker, so that a worker's
certificate names the one worker it may speak for. A service reads a caller's `Identity`
(`ClusterMembers.identity_of`) and looks the role up in its table of who may call what
(`runtime.access`). A certificate without a role (made before roles were) is no part of the
cluster's: every table refuses it, and `nonomad up` issues its part a new one.

Private keys, and every file written here, are mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from runtime.tracing import CLUSTER_NAME

__all__ = [
    "CLUSTER_NAME",
    "OPERATOR",
    "ROLES",
    "WORKER_PREFIX",
    "CertPaths",
    "ClusterCA",
    "ClusterMembers",
    "Identity",
    "part_role",
    "write_private",
]

_LOOPBACK = ("localhost", "127.0.0.1", "::1")

OPERATOR = "operator"
"""The role of the operator's CLI certificate (`nonomad status` asks workers directly)."""
ROLES = ("flaps", "proxy", "registry", "flyd", "console", OPERATOR)
"""What a cluster certificate may be: a part of the cluster, or the operator."""
WORKER_PREFIX = "flyd-"
"""A worker's certificate is named `flyd-<worker id>`: the worker it speaks for."""
_CLI_PART = "cli"  # the operator's certificate, by the name `nonomad up` has always given it


def part_role(part: str) -> str:
    """The role of the certificate of `part`, by the names the cluster gives its parts:
    `flyd-<worker id>` a worker, `cli` the operator, `<role>` or `<role>-<more>` (`proxy-ams`)
    one of ROLES. ValueError naming the part for anything else."""
    if part == _CLI_PART:
        return OPERATOR
    role = part.split("-", 1)[0]
    if role == "flyd" and not (part.startswith(WORKER_PREFIX) and part[len(WORKER_PREFIX) :]):
        raise ValueError(f"part {part!r}: a worker's certificate is {WORKER_PREFIX}<worker id>")
    if role not in ROLES:
        raise ValueError(f"part {part!r} has no role: name it {', '.join(ROLES)} (or cli)")
    return role


@dataclass(frozen=True)
class Identity:
    """Who a cluster certificate says its holder is: `name` (its common name) and `role` (one
    of ROLES; None when it names none: it is refused everywhere)."""

    name: str
    role: str | None

    @property
    def worker_id(self) -> str | None:
        """The worker a flyd certificate speaks for (from `flyd-<worker id>`); else None."""
        if self.role != "flyd" or not self.name.startswith(WORKER_PREFIX):
            return None
        return self.name.removeprefix(WORKER_PREFIX) or None

    def __str__(self) -> str:
        return f"{self.name!r} (role {self.role or 'none'})"

    @classmethod
    def of(cls, cert: x509.Certificate) -> Identity:
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        role = str(units[0].value) if len(units) == 1 else None
        name = str(names[0].value) if names else "(no common name)"
        return cls(name, role if role in ROLES else None)


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path`, readable by its owner only (0600) from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@dataclass(frozen=True)
class CertPaths:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: every TLS stack speaks it, and a key takes a millisecond to make.
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


class ClusterCA:
    """The CA of one cluster, kept in a directory as `ca.pem` and `ca.key`.

    `ClusterCA.ensure(directory)` opens it, creating it on first use; `issue(name, role)`
    writes `<name>.pem` and `<name>.key` beside it (reusing them when they exist, this CA
    signed them and they name that role), for use as a server and as a client.
    """

    def __init__(self, directory: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey):
        self.directory = directory
        self.cert = cert
        self._key = key

    @property
    def path(self) -> Path:
        """The CA certificate (PEM): what every part trusts."""
        return self.directory / "ca.pem"

    @classmethod
    def ensure(cls, directory: Path, *, days: int = 3650) -> ClusterCA:
        """The CA in `directory`, made now if there is none."""
        cert_path, key_path = directory / "ca.pem", directory / "ca.key"
        if cert_path.exists() and key_path.exists():
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{key_path}: not an EC private key")
            return cls(directory, cert, key)
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nonomad cluster CA")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        write_private(key_path, _key_pem(key))
        write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return cls(directory, cert, key)

    def issue(
        self, name: str, role: str, *, hosts: tuple[str, ...] = (), days: int = 365
    ) -> CertPaths:
        """The certificate of part `name` (`flaps`, `flyd-ams-1`, `cli`) in `role` (ROLES),
        made if missing, or if the one there names no role or another (made before roles).

        It names CLUSTER_NAME, the loopback names and `hosts`, and serves both as a server and
        as a client certificate. A flyd certificate must be named `flyd-<worker id>`.
        """
        if role not in ROLES:
            raise ValueError(f"role {role!r}: not one of {', '.join(ROLES)}")
        wanted = Identity(name, role)
        if role == "flyd" and wanted.worker_id is None:
            raise ValueError(f"{name!r}: a worker's certificate is {WORKER_PREFIX}<worker id>")
        paths = CertPaths(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        if paths.cert.exists() and paths.key.exists() and self._signed(paths.cert) == wanted:
            return paths
        key = _new_key()
        now = datetime.datetime.now(datetime.UTC)
        names = dict.fromkeys((CLUSTER_NAME, *_LOOPBACK, *hosts))
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        write_private(paths.key, _key_pem(key))
        write_private(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
        return paths

    def _signed(self, path: Path) -> Identity | None:
        """Who the certificate at `path` names, if this CA issued it and it is still valid."""
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
            cert.verify_directly_issued_by(self.cert)
        except (ValueError, TypeError, InvalidSignature):
            return None
        if cert.not_valid_after_utc <= datetime.datetime.now(datetime.UTC):
            return None
        return Identity.of(cert)


class ClusterMembers:
    """Tells who a call's client certificate says it is, if the cluster CA signed it.

    A listener with mutual TLS has already checked the certificate against its own client CA;
    this checks it against the cluster's, for a service whose listeners trust other CAs too
    (flaps: its public port may ask for other certificates, its cluster port for the
    cluster's). A verdict is kept per certificate (at most `keep` of them), so each is read
    and checked once.
    """

    def __init__(self, ca: Path, *, keep: int = 1024) -> None:
        self._ca = x509.load_pem_x509_certificate(ca.read_bytes())
        self._seen: dict[bytes, Identity | None] = {}
        self._keep = keep

    def identity_of(self, context: Any) -> Identity | None:
        """Who the caller's certificate names if the cluster CA signed it; None without a
        certificate, or for another CA's.

        A call without a peer identity presented no certificate: that is known without
        building the call's whole auth context (a dozen properties, the PEM among them), which
        costs a public port's every call more than the rest of its check."""
        if context.peer_identity_key() is None:
            return None
        pem = context.auth_context().get("x509_pem_cert")
        if not pem:
            return None
        key = bytes(pem[0])
        try:
            return self._seen[key]
        except KeyError:
            pass
        identity = self._verify(key)
        if len(self._seen) >= self._keep:
            self._seen.clear()
        self._seen[key] = identity
        return identity

    def _verify(self, pem: bytes) -> Identity | None:
        try:
            cert = x509.load_pem_x509_certificate(pem)
            cert.verify_directly_issued_by(self._ca)
        except (ValueError, TypeError, InvalidSignature):
            return None
        return Identity.of(cert)
