"""The connection flags against a flaps that serves mutual TLS."""

from __future__ import annotations

import asyncio

from tests.cli.conftest import nonomad
from tests.cli.test_machines import one_line_error
from tests.flaps.conftest import Fleet
from tests.runtime.conftest import Certs, certs

__all__ = ["certs"]


async def test_mutual_tls_flags(fleet: Fleet, certs: Certs) -> None:
    fleet.add_flaps(
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
        "--tls-client-ca", str(certs.ca),
    )  # fmt: skip
    flaps = ["--flaps", fleet.flaps[0].address, "--tls-ca", str(certs.ca)]
    client = ["--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key)]
    mutual, anonymous, plaintext = await asyncio.gather(
        nonomad("workers", "--json", *flaps, *client),
        nonomad("workers", *flaps),
        nonomad("workers", "--flaps", fleet.flaps[0].address),
    )
    assert mutual.json() == []  # a flaps that follows no workers yet
    # Without a client certificate the handshake fails; so does plaintext against TLS.
    for failed in (anonymous, plaintext):
        one_line_error(failed, 1, f"flaps at {fleet.flaps[0].address}", "--tls-cert")
