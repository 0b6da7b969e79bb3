"""Administrator enrollment tokens (domain/enrollment_token.py)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.enrollment_token import (
    MAX_TOKEN_LENGTH,
    TOKEN_PREFIX,
    BadSignatureError,
    ExpiredTokenError,
    InvalidTokenError,
    MalformedTokenError,
    NodeMismatchError,
    TokenClaims,
    TokenErrorCode,
    mint_token,
    verify_token,
)

SECRET = b"test-secret-not-for-production-0123456789"
OTHER_SECRET = b"another-secret-not-for-production-987654"
NOW = 1_700_000_000.0


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(secret: bytes, signing_input: str) -> str:
    return b64(hmac.new(secret, signing_input.encode("ascii"), hashlib.sha256).digest())


def token(
    *,
    token_id: str = "tok-1",
    expires_at: float = NOW + 3600,
    single_use: bool = True,
    node_name: str | None = None,
    secret: bytes = SECRET,
) -> str:
    return mint_token(secret, token_id, expires_at, single_use, node_name)


# ---------------------------------------------------------------------------------------------
# round trip


def test_round_trip_unbound() -> None:
    t = token(token_id="abc123", single_use=False)
    claims = verify_token(SECRET, t, NOW, "any-node")
    assert claims == TokenClaims("abc123", NOW + 3600, False, None)
    assert verify_token(SECRET, t, NOW, None) == claims


def test_round_trip_bound_and_single_use() -> None:
    t = token(token_id="xyz", node_name="gpu-box-1", single_use=True)
    claims = verify_token(SECRET, t, NOW, "gpu-box-1")
    assert claims.token_id == "xyz"
    assert claims.single_use is True
    assert claims.node_name == "gpu-box-1"
    assert claims.expires_at == NOW + 3600


def test_token_shape_is_compact_and_url_safe() -> None:
    t = token(node_name="node-ü")  # non-ASCII names survive via JSON escapes
    prefix, claims_b64, mac_b64 = t.split(".")
    assert prefix == TOKEN_PREFIX == "dacp1"
    assert "=" not in t and "+" not in t and "/" not in t
    assert len(unb64(mac_b64)) == 32
    assert json.loads(unb64(claims_b64)) == {
        "tid": "tok-1",
        "exp": NOW + 3600,
        "su": True,
        "node": "node-ü",
    }
    assert verify_token(SECRET, t, NOW, "node-ü").node_name == "node-ü"


def test_minting_is_deterministic() -> None:
    assert token() == token()
    assert token(token_id="a") != token(token_id="b")


def test_surrounding_whitespace_tolerated() -> None:
    assert verify_token(SECRET, f"  {token()}\n", NOW, None).token_id == "tok-1"


@settings(max_examples=200, deadline=None)
@given(
    token_id=st.text(min_size=1, max_size=40),
    expires_at=st.floats(min_value=-1e12, max_value=1e12, allow_nan=False),
    single_use=st.booleans(),
    node_name=st.none() | st.text(min_size=1, max_size=40),
)
def test_property_round_trip(
    token_id: str, expires_at: float, single_use: bool, node_name: str | None
) -> None:
    t = mint_token(SECRET, token_id, expires_at, single_use, node_name)
    claims = verify_token(SECRET, t, expires_at - 1.0, node_name)
    assert claims == TokenClaims(token_id, expires_at, single_use, node_name)
    with pytest.raises(BadSignatureError):
        verify_token(OTHER_SECRET, t, expires_at - 1.0, node_name)


# ---------------------------------------------------------------------------------------------
# signature


def test_wrong_secret_is_bad_signature() -> None:
    with pytest.raises(BadSignatureError) as info:
        verify_token(OTHER_SECRET, token(), NOW, None)
    assert info.value.reason_code is TokenErrorCode.BAD_SIGNATURE
    assert isinstance(info.value, InvalidTokenError)


def test_forged_signature_is_rejected() -> None:
    prefix, claims_b64, _ = token().split(".")
    zeros = b64(bytes(32))
    forged = f"{prefix}.{claims_b64}.{zeros}"
    with pytest.raises(BadSignatureError):
        verify_token(SECRET, forged, NOW, None)
    # a signature made with another key over the same claims
    other = f"{prefix}.{claims_b64}.{sign(OTHER_SECRET, f'{prefix}.{claims_b64}')}"
    with pytest.raises(BadSignatureError):
        verify_token(SECRET, other, NOW, None)
    # a truncated signature
    short = f"{prefix}.{claims_b64}.{b64(unb64(token().split('.')[2])[:16])}"
    with pytest.raises(BadSignatureError):
        verify_token(SECRET, short, NOW, None)


def test_tampered_claims_are_rejected() -> None:
    prefix, _, mac_b64 = token(node_name="a", single_use=True).split(".")
    for claims in (
        {"tid": "tok-1", "exp": NOW + 10 * 365 * 86400, "su": True, "node": "a"},
        {"tid": "tok-1", "exp": NOW + 3600, "su": False, "node": "a"},
        {"tid": "tok-1", "exp": NOW + 3600, "su": True, "node": None},
        {"tid": "tok-2", "exp": NOW + 3600, "su": True, "node": "a"},
    ):
        payload = b64(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
        with pytest.raises(BadSignatureError):
            verify_token(SECRET, f"{prefix}.{payload}.{mac_b64}", NOW, "a")


def test_every_single_character_change_is_rejected() -> None:
    t = token(node_name="n1")
    alphabet = "AQgw_-"
    for i, ch in enumerate(t):
        for replacement in alphabet:
            if replacement == ch:
                continue
            changed = t[:i] + replacement + t[i + 1 :]
            with pytest.raises(InvalidTokenError):
                verify_token(SECRET, changed, NOW, "n1")


def test_signature_covers_version_prefix() -> None:
    _, claims_b64, mac_b64 = token().split(".")
    with pytest.raises(MalformedTokenError):
        verify_token(SECRET, f"dacp2.{claims_b64}.{mac_b64}", NOW, None)


def test_signed_but_invalid_claims_are_malformed() -> None:
    # only someone with the secret could produce these; they are still refused cleanly
    for raw in (
        b"not json",
        b"[]",
        b'{"tid":"t","exp":1e20,"su":true}',
        b'{"tid":"","exp":1e20,"su":true,"node":null}',
        b'{"tid":"t","exp":"soon","su":true,"node":null}',
        b'{"tid":"t","exp":true,"su":true,"node":null}',
        b'{"tid":"t","exp":NaN,"su":true,"node":null}',
        b'{"tid":"t","exp":1e20,"su":1,"node":null}',
        b'{"tid":"t","exp":1e20,"su":true,"node":""}',
        b'{"tid":"t","exp":1e20,"su":true,"node":null,"extra":1}',
        b"\xff\xfe",
    ):
        signing_input = f"{TOKEN_PREFIX}.{b64(raw)}"
        t = f"{signing_input}.{sign(SECRET, signing_input)}"
        with pytest.raises(MalformedTokenError):
            verify_token(SECRET, t, NOW, None)


# ---------------------------------------------------------------------------------------------
# expiry and binding


def test_expired_token() -> None:
    t = token(expires_at=NOW)
    with pytest.raises(ExpiredTokenError) as info:
        verify_token(SECRET, t, NOW, None)
    assert info.value.reason_code is TokenErrorCode.EXPIRED
    with pytest.raises(ExpiredTokenError):
        verify_token(SECRET, t, NOW + 1, None)
    assert verify_token(SECRET, t, NOW - 0.001, None).token_id == "tok-1"


def test_expiry_is_shown_as_an_iso_time() -> None:
    with pytest.raises(ExpiredTokenError) as info:
        verify_token(SECRET, token(expires_at=1_796_472_000), 1_796_472_060, None)
    assert "expired at 2026-12-05T12:00:00Z (now 2026-12-05T12:01:00Z)" in info.value.message


def test_bad_signature_checked_before_expiry() -> None:
    with pytest.raises(BadSignatureError):
        verify_token(OTHER_SECRET, token(expires_at=NOW - 10), NOW, None)


def test_bound_to_another_node_name() -> None:
    t = token(node_name="gpu-box-1")
    with pytest.raises(NodeMismatchError) as info:
        verify_token(SECRET, t, NOW, "gpu-box-2")
    assert info.value.reason_code is TokenErrorCode.NODE_MISMATCH
    assert "gpu-box-1" in info.value.message
    with pytest.raises(NodeMismatchError):
        verify_token(SECRET, t, NOW, None)
    with pytest.raises(NodeMismatchError):
        verify_token(SECRET, t, NOW, "GPU-BOX-1")


def test_expiry_checked_before_binding() -> None:
    with pytest.raises(ExpiredTokenError):
        verify_token(SECRET, token(node_name="a", expires_at=NOW - 1), NOW, "b")


# ---------------------------------------------------------------------------------------------
# malformed input


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        " ",
        "garbage",
        "dacp1",
        "dacp1..",
        "dacp1.abc",
        "dacp1.a.b.c",
        "jwt.eyJhbGciOiJIUzI1NiJ9.sig",
        "dacp1.!!!!.AAAA",
        "dacp1.YWJj.AAAA=",
        "dacp1.YWJj.A",
        "dacp1.YWJ+.AAAA",
        "dacp1.YWJj.AAB",  # non-canonical base64url (trailing bits set)
        "dacp1.\u00e9\u00e9\u00e9\u00e9.AAAA",
        "x" * (MAX_TOKEN_LENGTH + 1),
    ],
)
def test_malformed_garbage(garbage: str) -> None:
    with pytest.raises(MalformedTokenError) as info:
        verify_token(SECRET, garbage, NOW, None)
    assert info.value.reason_code is TokenErrorCode.MALFORMED
    assert str(info.value)


def test_non_string_token_is_malformed() -> None:
    with pytest.raises(MalformedTokenError):
        verify_token(SECRET, b"dacp1.a.b", NOW, None)  # type: ignore[arg-type]
    with pytest.raises(MalformedTokenError):
        verify_token(SECRET, None, NOW, None)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_property_arbitrary_text_never_verifies(text: str) -> None:
    with pytest.raises(InvalidTokenError):
        verify_token(SECRET, text, NOW, None)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_property_random_mutation_never_verifies(data: st.DataObject) -> None:
    t = token(node_name="n")
    i = data.draw(st.integers(min_value=0, max_value=len(t) - 1))
    replacement = data.draw(st.characters(codec="ascii").filter(lambda c: c != t[i]))
    changed = t[:i] + replacement + t[i + 1 :]
    with pytest.raises(InvalidTokenError):
        verify_token(SECRET, changed, NOW, "n")


# ---------------------------------------------------------------------------------------------
# argument validation (programming errors, not token errors)


@pytest.mark.parametrize(
    ("secret", "token_id", "expires_at", "node_name"),
    [
        (b"", "t", NOW, None),
        (SECRET, "", NOW, None),
        (SECRET, "t", float("inf"), None),
        (SECRET, "t", float("nan"), None),
        (SECRET, "t", NOW, ""),
    ],
)
def test_mint_rejects_bad_arguments(
    secret: bytes, token_id: str, expires_at: float, node_name: str | None
) -> None:
    with pytest.raises(ValueError):
        mint_token(secret, token_id, expires_at, True, node_name)


def test_verify_rejects_empty_secret() -> None:
    with pytest.raises(ValueError):
        verify_token(b"", token(), NOW, None)


def test_error_hierarchy_and_codes() -> None:
    assert MalformedTokenError().reason_code is TokenErrorCode.MALFORMED
    assert BadSignatureError().reason_code is TokenErrorCode.BAD_SIGNATURE
    assert ExpiredTokenError().reason_code is TokenErrorCode.EXPIRED
    assert NodeMismatchError().reason_code is TokenErrorCode.NODE_MISMATCH
    err = InvalidTokenError(TokenErrorCode.EXPIRED, "custom")
    assert err.reason_code == "expired"
    assert err.message == str(err) == "custom"
