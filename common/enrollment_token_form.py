"""The form of an enrollment token, shared by the controller, which mints and verifies tokens
(``domain/enrollment_token.py``), and the node agent, which checks a token's form before it
connects and reads from it the CA it pins.

A token is ``dacp1.<base64url(json claims)>.<base64url(hmac-sha256)>`` without padding. Nothing
here checks the MAC: that takes the secret, which only the controller has.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any

TOKEN_PREFIX = "dacp1"
MAX_TOKEN_LENGTH = 4096
#: The MAC is an HMAC-SHA256: 32 bytes.
MAC_BYTES = 32
#: The claims every token has: its id, expiry (unix seconds), single-use flag and node name.
CLAIM_KEYS = frozenset({"tid", "exp", "su", "node"})
#: The optional claim: the sha256 fingerprint of the controller's CA, which the agent pins.
CA_KEY = "ca"
FINGERPRINT = re.compile(r"[0-9a-f]{64}")

_B64URL = re.compile(r"[A-Za-z0-9_-]+")
_SHAPE = f"{TOKEN_PREFIX}.<claims>.<mac>"


class TokenFormError(ValueError):
    """The token is not in the form above; the message says what is wrong, in one line."""


@dataclass(frozen=True, slots=True)
class TokenParts:
    """A token split into its parts, each decoded (nothing verified)."""

    claims_b64: str
    payload: bytes
    mac: bytes

    @property
    def signing_input(self) -> str:
        """What the MAC covers: the prefix and the encoded claims."""
        return f"{TOKEN_PREFIX}.{self.claims_b64}"


@dataclass(frozen=True, slots=True)
class TokenFields:
    """The claims of a well-formed token (not verified: anyone can write these)."""

    token_id: str
    expires_at: float
    single_use: bool
    node_name: str | None
    ca_fingerprint: str | None


def b64encode(raw: bytes) -> str:
    """base64url without padding, as tokens carry their parts."""
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str, part: str) -> bytes:
    """Strict, canonical base64url without padding."""
    if not _B64URL.fullmatch(text):
        raise TokenFormError(f"its {part} part is not base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise TokenFormError(f"its {part} part is not base64url (cut short?)") from None
    if b64encode(raw) != text:
        raise TokenFormError(f"its {part} part is not canonical base64url (cut short?)")
    return raw


def split_token(token: object) -> TokenParts:
    """The token's parts (surrounding whitespace ignored); raises :class:`TokenFormError`."""
    if not isinstance(token, str) or not token.strip():
        raise TokenFormError("it is empty")
    if len(token) > MAX_TOKEN_LENGTH:
        raise TokenFormError(f"it has {len(token)} characters, more than {MAX_TOKEN_LENGTH}")
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise TokenFormError(f"it must look like {_SHAPE}")
    _, claims_b64, mac_b64 = parts
    return TokenParts(claims_b64, _b64decode(claims_b64, "claims"), _b64decode(mac_b64, "MAC"))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def parse_claims(payload: bytes) -> TokenFields:
    """The claims of a token, checked for form; raises :class:`TokenFormError`."""
    try:
        data = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError):
        raise TokenFormError("its claims are not JSON") from None
    if not isinstance(data, dict) or set(data) - {CA_KEY} != CLAIM_KEYS:
        raise TokenFormError("its claims have the wrong fields")
    ca = data.get(CA_KEY)
    if ca is not None and (not isinstance(ca, str) or not FINGERPRINT.fullmatch(ca)):
        raise TokenFormError("its CA fingerprint is invalid")
    token_id, exp, single_use, node = data["tid"], data["exp"], data["su"], data["node"]
    if not isinstance(token_id, str) or not token_id:
        raise TokenFormError("its id is missing")
    if isinstance(exp, bool) or not isinstance(exp, int | float) or not math.isfinite(exp):
        raise TokenFormError("its expiry is not a number")
    if not isinstance(single_use, bool):
        raise TokenFormError("its single-use flag is not a boolean")
    if node is not None and (not isinstance(node, str) or not node):
        raise TokenFormError("its node name is invalid")
    return TokenFields(token_id, float(exp), single_use, node, ca)


def read_token(token: object) -> TokenFields:
    """The claims of a token whose form is whole (its MAC as long as an HMAC-SHA256 is: a
    token cut short at a multiple of 4 characters still decodes); raises
    :class:`TokenFormError`. What an agent checks before it sends a token anywhere."""
    parts = split_token(token)
    fields = parse_claims(parts.payload)
    if len(parts.mac) != MAC_BYTES:
        raise TokenFormError(f"its MAC is {len(parts.mac)} bytes, not {MAC_BYTES} (cut short?)")
    return fields
