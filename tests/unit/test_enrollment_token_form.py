"""The enrollment token's form as the agent checks it before connecting
(common/enrollment_token_form.py): a token cut short or garbled is named as such, and its
claims read without the secret."""

from __future__ import annotations

import pytest

from common.enrollment_token_form import MAC_BYTES, TokenFormError, read_token
from domain.enrollment_token import mint_token
from domain.times import iso_time

SECRET = b"test-secret-not-for-production-0123456789"
CA = "ab" * 32


def _token() -> str:
    return mint_token(SECRET, "tok-1", 1_796_472_000, True, "gpu-1", CA)


def test_a_whole_token_reads_without_the_secret() -> None:
    fields = read_token(f"  {_token()}\n")
    assert (fields.token_id, fields.single_use, fields.node_name) == ("tok-1", True, "gpu-1")
    assert fields.ca_fingerprint == CA
    assert iso_time(fields.expires_at) == "2026-12-05T12:00:00Z"


@pytest.mark.parametrize("keep", [-1, -2, -3, -4, -8, -40])
def test_a_token_cut_short_is_refused_with_what_is_wrong(keep: int) -> None:
    with pytest.raises(TokenFormError, match=r"cut short|base64url|look like") as info:
        read_token(_token()[:keep])
    assert "\n" not in str(info.value)


def test_a_token_cut_at_four_characters_names_its_short_mac() -> None:
    token = _token()
    mac_chars = len(token.rsplit(".", 1)[1])
    cut = token[: len(token) - mac_chars + 40]  # 40 characters: 30 bytes, decodes cleanly
    with pytest.raises(TokenFormError, match=f"MAC is 30 bytes, not {MAC_BYTES}"):
        read_token(cut)


@pytest.mark.parametrize(
    ("garbled", "what"),
    [
        ("", "empty"),
        ("hello", "must look like dacp1.<claims>.<mac>"),
        ("dacp1.e30.AAAA", "claims have the wrong fields"),
        ("dacp1.bm90IGpzb24.AAAA", "claims are not JSON"),
        ("dacp1.e30!.AAAA", "claims part is not base64url"),
    ],
)
def test_garbled_tokens_say_what_is_wrong(garbled: str, what: str) -> None:
    with pytest.raises(TokenFormError, match=what.replace(".", r"\.")):
        read_token(garbled)
