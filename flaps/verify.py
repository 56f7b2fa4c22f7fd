"""flaps.v1.TokenService: tokens verified for the edge, which holds no root keys.

Macaroons are HMAC: whatever verifies one can also mint one. The proxy, facing the internet,
must not be able to mint an admin token if it is broken into, so it holds no root keys; a
token it is handed (`nonomad-token`, to pin a request to one machine) it asks flaps about,
on flaps' cluster port with its certificate (`TOKEN_ACCESS`: the proxy's role only), and
keeps the answer for a few seconds (proxy.pins). flaps verifies it as it verifies the tokens
of its own calls (flaps.auth.TokenVerifier: signature, expiry, revocation list), and answers
the grant (id, caveats, expiry) for the proxy to check its request against, or why the
token is not valid. docs/auth.md says why this rather than a key that only verifies.
"""

from __future__ import annotations

import grpc
import structlog

from flaps.auth import TokenVerifier
from flaps.errors import InvalidArgument
from flaps.v1 import tokens_pb2 as t
from flaps.v1 import tokens_pb2_grpc
from model.tokens import InvalidToken
from runtime.access import allow, table

__all__ = ["MAX_TOKEN_BYTES", "TOKEN_ACCESS", "TokenServicer"]

log = structlog.get_logger("flaps.verify")

MAX_TOKEN_BYTES = 8192
"""Longer than any token flaps mints, attenuated many times over."""

TOKEN_ACCESS = table(
    t.DESCRIPTOR.services_by_name["TokenService"],
    {"VerifyToken": allow("proxy")},
)
"""Who may ask flaps about a token: the edge, the one part that takes tokens and holds no
root keys."""


class TokenServicer(tokens_pb2_grpc.TokenServiceServicer):
    """Answers whether a token is valid, and what it allows, with `tokens`."""

    def __init__(self, tokens: TokenVerifier) -> None:
        self.tokens = tokens

    async def VerifyToken(
        self, request: t.VerifyTokenRequest, context: grpc.aio.ServicerContext
    ) -> t.VerifyTokenResponse:
        token = request.token.strip()
        if not token:
            raise InvalidArgument("token", "is required")
        if len(token) > MAX_TOKEN_BYTES:
            raise InvalidArgument("token", f"is over {MAX_TOKEN_BYTES} bytes")
        try:
            grant = self.tokens.verify(token)
        except InvalidToken as err:
            log.info("token_refused", reason=str(err))
            return t.VerifyTokenResponse(refused=str(err))
        answer = t.VerifyTokenResponse(
            token_id=grant.token_id, caveats=[c.text for c in grant.caveats]
        )
        answer.expires.FromSeconds(grant.expires)
        return answer
