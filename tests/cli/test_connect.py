"""The connection flags against a flaps that serves TLS and checks tokens, on its public port
and on its cluster port (mutual TLS)."""

from __future__ import annotations

import asyncio

from tests.cli.conftest import nonomad
from tests.cli.support import one_line_error
from tests.flaps.conftest import Fleet


async def test_tls_token_and_client_certificate_flags(fleet: Fleet) -> None:
    assert fleet.security is not None
    flaps = fleet.add_flaps()
    ca = ["--tls-ca", str(fleet.security.ca)]
    token = ["--token-file", str(fleet.security.admin_token)]
    cli = fleet.security.cert("cli")
    cert = ["--tls-cert", str(cli.cert), "--tls-key", str(cli.key)]
    public, cluster = ["--flaps", flaps.address], ["--flaps", flaps.cluster_address]
    with_token, member, no_token, anonymous, plaintext = await asyncio.gather(
        nonomad("workers", "--json", *public, *ca, *token),
        nonomad("workers", "--json", *cluster, *ca, *cert),  # a cluster certificate: no token
        nonomad("workers", *public, *ca),
        nonomad("workers", *cluster, *ca, *token),
        nonomad("workers", *public),
    )
    assert with_token.json() == member.json() == []  # a flaps that follows no workers yet
    one_line_error(no_token, 1, "UNAUTHENTICATED", "--token-file")
    # The cluster port wants a client certificate; plaintext against TLS fails too.
    for failed in (anonymous, plaintext):
        one_line_error(failed, 1, "flaps at", "--tls-cert")
