"""Administrator enrollment tokens (minted by ``POST /api/admin/enrollment-tokens``
and ``dacp token create``; see docs/control-channel.md, 'Enrollment').

A token is ``dacp1.<base64url(json claims)>.<base64url(hmac-sha256)>`` without padding. The
HMAC key is ``NODE_ENROLLMENT_SECRET``; the MAC covers ``dacp1.<claims>`` so neither the version
nor the claims can be changed without the secret. The form itself (prefix, parts, claims) is
``common/enrollment_token_form.py``'s, which the agent checks too before it sends a token.

Pure: the caller passes the secret, the random token id and the current time. Single use needs
state, so it is only exposed (``TokenClaims.single_use`` and ``token_id``); the application
refuses a second enrollment with a single-use token id.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from common.enrollment_token_form import (
    CA_KEY,
    FINGERPRINT,
    MAX_TOKEN_LENGTH,
    TOKEN_PREFIX,
    TokenFormError,
    b64encode,
    parse_claims,
    split_token,
)
from domain.times import iso_time

#: Part of this module's interface (tests and callers import them from here).
__all__ = [
    "MAX_TOKEN_LENGTH",
    "TOKEN_PREFIX",
    "BadSignatureError",
    "ExpiredTokenError",
    "InvalidTokenError",
    "MalformedTokenError",
    "NodeMismatchError",
    "TokenClaims",
    "TokenErrorCode",
    "mint_token",
    "verify_token",
]


class TokenErrorCode(StrEnum):
    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad_signature"
    EXPIRED = "expired"
    NODE_MISMATCH = "node_mismatch"


class InvalidTokenError(Exception):
    """An enrollment token was refused. ``reason_code`` is a :class:`TokenErrorCode`."""

    def __init__(self, reason_code: TokenErrorCode, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code
        self.message = message


class MalformedTokenError(InvalidTokenError):
    def __init__(self, message: str = "enrollment token is malformed") -> None:
        super().__init__(TokenErrorCode.MALFORMED, message)


class BadSignatureError(InvalidTokenError):
    def __init__(
        self, message: str = "enrollment token signature is invalid (forged or wrong secret)"
    ) -> None:
        super().__init__(TokenErrorCode.BAD_SIGNATURE, message)


class ExpiredTokenError(InvalidTokenError):
    def __init__(self, message: str = "enrollment token has expired") -> None:
        super().__init__(TokenErrorCode.EXPIRED, message)


class NodeMismatchError(InvalidTokenError):
    def __init__(self, message: str = "enrollment token is bound to another node name") -> None:
        super().__init__(TokenErrorCode.NODE_MISMATCH, message)


@dataclass(frozen=True, slots=True)
class TokenClaims:
    token_id: str
    expires_at: float
    single_use: bool
    node_name: str | None
    ca_fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        claims: dict[str, Any] = {
            "tid": self.token_id,
            "exp": self.expires_at,
            "su": self.single_use,
            "node": self.node_name,
        }
        if self.ca_fingerprint is not None:
            claims[CA_KEY] = self.ca_fingerprint
        return claims


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ValueError("the enrollment secret must be non-empty bytes")


def _mac(secret: bytes, signing_input: str) -> bytes:
    return hmac.new(secret, signing_input.encode("ascii"), hashlib.sha256).digest()


def mint_token(
    secret: bytes,
    token_id: str,
    expires_at: float,
    single_use: bool,
    node_name: str | None,
    ca_fingerprint: str | None = None,
) -> str:
    """Sign a token valid strictly before ``expires_at`` (unix seconds).

    ``node_name`` binds the token to the agent that enrolls under exactly that name;
    ``ca_fingerprint`` (sha256 of the controller's CA, hex) is what the agent pins.
    """
    _check_secret(secret)
    if not isinstance(token_id, str) or not token_id:
        raise ValueError("token_id must be a non-empty string")
    if isinstance(expires_at, bool) or not isinstance(expires_at, int | float):
        raise ValueError("expires_at must be a number")
    if not math.isfinite(expires_at):
        raise ValueError("expires_at must be finite")
    if node_name is not None and (not isinstance(node_name, str) or not node_name):
        raise ValueError("node_name must be None or a non-empty string")
    if ca_fingerprint is not None and not FINGERPRINT.fullmatch(ca_fingerprint):
        raise ValueError("ca_fingerprint must be 64 lowercase hex digits")
    claims = TokenClaims(token_id, float(expires_at), bool(single_use), node_name, ca_fingerprint)
    payload = json.dumps(
        claims.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    ).encode("ascii")
    signing_input = f"{TOKEN_PREFIX}.{b64encode(payload)}"
    return f"{signing_input}.{b64encode(_mac(secret, signing_input))}"


def _parse_claims(payload: bytes) -> TokenClaims:
    try:
        fields = parse_claims(payload)
    except TokenFormError as e:
        raise MalformedTokenError(f"enrollment token is malformed: {e}") from None
    return TokenClaims(
        fields.token_id,
        fields.expires_at,
        fields.single_use,
        fields.node_name,
        fields.ca_fingerprint,
    )


def verify_token(secret: bytes, token: str, now: float, node_name: str | None) -> TokenClaims:
    """Check a token's form, signature, expiry and node binding, in that order.

    ``node_name`` is the name the enrolling agent presents; a token bound to a name accepts only
    exactly that name (and refuses ``None``). Raises an :class:`InvalidTokenError` subclass.
    """
    _check_secret(secret)
    try:
        parts = split_token(token)
    except TokenFormError as e:
        raise MalformedTokenError(f"enrollment token is malformed: {e}") from None
    if not hmac.compare_digest(parts.mac, _mac(secret, parts.signing_input)):
        raise BadSignatureError()
    claims = _parse_claims(parts.payload)
    if now >= claims.expires_at:
        raise ExpiredTokenError(
            f"enrollment token {claims.token_id} expired at {iso_time(claims.expires_at)} "
            f"(now {iso_time(now)})"
        )
    if claims.node_name is not None and node_name != claims.node_name:
        raise NodeMismatchError(
            f"enrollment token {claims.token_id} is bound to node name {claims.node_name!r}, "
            f"not {node_name!r}"
        )
    return claims
