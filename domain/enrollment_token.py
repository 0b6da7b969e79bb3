"""Administrator enrollment tokens (minted by ``POST /api/admin/enrollment-tokens``
and ``dacp token create``; see docs/architecture.md, 'Enrollment').

A token is ``dacp1.<base64url(json claims)>.<base64url(hmac-sha256)>`` without padding. The
HMAC key is ``NODE_ENROLLMENT_SECRET``; the MAC covers ``dacp1.<claims>`` so neither the version
nor the claims can be changed without the secret.

Pure: the caller passes the secret, the random token id and the current time. Single use needs
state, so it is only exposed (``TokenClaims.single_use`` and ``token_id``); the application
refuses a second enrollment with a single-use token id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

TOKEN_PREFIX = "dacp1"
MAX_TOKEN_LENGTH = 4096

_B64URL = re.compile(r"[A-Za-z0-9_-]+")
_CLAIM_KEYS = frozenset({"tid", "exp", "su", "node"})
#: Optional: the sha256 fingerprint of the controller's CA, which the agent pins.
_CA_KEY = "ca"
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


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
            claims[_CA_KEY] = self.ca_fingerprint
        return claims


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    """Strict, canonical base64url without padding; raises ``MalformedTokenError``."""
    if not _B64URL.fullmatch(text):
        raise MalformedTokenError("enrollment token is not base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise MalformedTokenError("enrollment token is not base64url") from None
    if _b64encode(raw) != text:
        raise MalformedTokenError("enrollment token is not canonical base64url")
    return raw


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
    if ca_fingerprint is not None and not _FINGERPRINT.fullmatch(ca_fingerprint):
        raise ValueError("ca_fingerprint must be 64 lowercase hex digits")
    claims = TokenClaims(token_id, float(expires_at), bool(single_use), node_name, ca_fingerprint)
    payload = json.dumps(
        claims.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    ).encode("ascii")
    signing_input = f"{TOKEN_PREFIX}.{_b64encode(payload)}"
    return f"{signing_input}.{_b64encode(_mac(secret, signing_input))}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _parse_claims(payload: bytes) -> TokenClaims:
    try:
        data = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError):
        raise MalformedTokenError("enrollment token claims are not JSON") from None
    if not isinstance(data, dict) or set(data) - {_CA_KEY} != _CLAIM_KEYS:
        raise MalformedTokenError("enrollment token claims have the wrong fields")
    ca = data.get(_CA_KEY)
    if ca is not None and (not isinstance(ca, str) or not _FINGERPRINT.fullmatch(ca)):
        raise MalformedTokenError("enrollment token CA fingerprint is invalid")
    token_id, exp, single_use, node = data["tid"], data["exp"], data["su"], data["node"]
    if not isinstance(token_id, str) or not token_id:
        raise MalformedTokenError("enrollment token id is missing")
    if isinstance(exp, bool) or not isinstance(exp, int | float) or not math.isfinite(exp):
        raise MalformedTokenError("enrollment token expiry is not a number")
    if not isinstance(single_use, bool):
        raise MalformedTokenError("enrollment token single-use flag is not a boolean")
    if node is not None and (not isinstance(node, str) or not node):
        raise MalformedTokenError("enrollment token node name is invalid")
    return TokenClaims(token_id, float(exp), single_use, node, ca)


def verify_token(secret: bytes, token: str, now: float, node_name: str | None) -> TokenClaims:
    """Check a token's form, signature, expiry and node binding, in that order.

    ``node_name`` is the name the enrolling agent presents; a token bound to a name accepts only
    exactly that name (and refuses ``None``). Raises an :class:`InvalidTokenError` subclass.
    """
    _check_secret(secret)
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_LENGTH:
        raise MalformedTokenError()
    token = token.strip()
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise MalformedTokenError(f"enrollment token must look like {TOKEN_PREFIX}.<claims>.<mac>")
    _, claims_b64, mac_b64 = parts
    payload = _b64decode(claims_b64)
    mac = _b64decode(mac_b64)
    expected = _mac(secret, f"{TOKEN_PREFIX}.{claims_b64}")
    if not hmac.compare_digest(mac, expected):
        raise BadSignatureError()
    claims = _parse_claims(payload)
    if now >= claims.expires_at:
        raise ExpiredTokenError(
            f"enrollment token {claims.token_id} expired at {claims.expires_at:.0f} (now {now:.0f})"
        )
    if claims.node_name is not None and node_name != claims.node_name:
        raise NodeMismatchError(
            f"enrollment token {claims.token_id} is bound to node name {claims.node_name!r}, "
            f"not {node_name!r}"
        )
    return claims
