"""What `nonomad up` keeps usable in a state dir (nonomad.security.provision): each part's
certificate in its role, and the local tokens before they expire. Time is passed in (`now`)."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509

from model.tokens import DEFAULT_TTL, inspect, read_token
from nonomad.security import RENEW_WITHIN, provision
from runtime.pki import Identity
from tests.roles import legacy_certificate

NOW = 1_800_000_000.0


def identity(path: Path) -> Identity:
    return Identity.of(x509.load_pem_x509_certificate(path.read_bytes()))


def test_each_part_gets_a_certificate_in_its_role(tmp_path: Path) -> None:
    security = provision(tmp_path, ["flaps", "proxy", "console", "flyd-ams-1"], now=NOW)
    roles = {
        part: identity(security.cert(part).cert)
        for part in ("flaps", "proxy", "console", "flyd-ams-1", "cli")
    }
    assert roles == {
        "flaps": Identity("flaps", "flaps"),
        "proxy": Identity("proxy", "proxy"),
        "console": Identity("console", "console"),
        "flyd-ams-1": Identity("flyd-ams-1", "flyd"),
        "cli": Identity("cli", "operator"),
    }
    # A worker that joins later gets its own when it starts.
    security.worker_args("ams-2")
    assert identity(security.cert("flyd-ams-2").cert).worker_id == "ams-2"


def test_a_state_dir_from_before_roles_is_issued_again(tmp_path: Path) -> None:
    security = provision(tmp_path, ["proxy"], now=NOW)
    old = legacy_certificate(security.ca.parent, "proxy")
    old.cert.replace(security.cert("proxy").cert)
    old.key.replace(security.cert("proxy").key)
    assert identity(security.cert("proxy").cert).role is None
    provision(tmp_path, ["proxy"], now=NOW)
    assert identity(security.cert("proxy").cert) == Identity("proxy", "proxy")


def test_the_local_tokens_expire_and_are_renewed_as_they_near_it(tmp_path: Path) -> None:
    security = provision(tmp_path, ["flaps"], now=NOW)
    admin = read_token(security.admin_token)
    keys = security.keyring()
    assert keys.verify(admin, now=NOW).expires == int(NOW + DEFAULT_TTL)
    console = inspect(read_token(security.console_token))
    assert "ops = read,workers,regions" in console.caveats
    # Well before: kept as they are (their holders keep working).
    provision(tmp_path, ["flaps"], now=NOW + DEFAULT_TTL - RENEW_WITHIN - 60)
    assert read_token(security.admin_token) == admin
    # Near the end: minted again, good for another DEFAULT_TTL.
    later = NOW + DEFAULT_TTL - RENEW_WITHIN + 60
    provision(tmp_path, ["flaps"], now=later)
    renewed = read_token(security.admin_token)
    assert renewed != admin
    assert security.keyring().verify(renewed, now=later).expires == int(later + DEFAULT_TTL)
    assert inspect(read_token(security.console_token)).token_id != console.token_id


def test_a_revoked_local_token_is_minted_again(tmp_path: Path) -> None:
    security = provision(tmp_path, ["flaps"], now=NOW)
    admin = inspect(read_token(security.admin_token)).token_id
    security.revoked_tokens.write_text(f"{admin}  # revoked\n")
    provision(tmp_path, ["flaps"], now=NOW)
    assert inspect(read_token(security.admin_token)).token_id != admin
