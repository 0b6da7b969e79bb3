"""Feed tickets: valid for their time, under their admin key, ASCII, and nothing else."""

from __future__ import annotations

import pytest

from application.feed_tickets import (
    DEFAULT_FEED_SESSION_SECONDS,
    MAX_TICKET_LENGTH,
    TICKET_TTL,
    issue_ticket,
    session_end,
    ticket_valid,
)


def test_a_ticket_opens_the_feed_until_it_expires() -> None:
    minted = issue_ticket("admin-key", now=1000.0)
    assert minted.expires_at == 1000 + int(TICKET_TTL)
    assert minted.session_ends_at == 1000 + int(DEFAULT_FEED_SESSION_SECONDS)
    assert ticket_valid("admin-key", minted.ticket, now=1000.0)
    assert ticket_valid("admin-key", minted.ticket, now=minted.expires_at - 0.5)
    assert not ticket_valid("admin-key", minted.ticket, now=minted.expires_at)
    assert len(minted.ticket) <= MAX_TICKET_LENGTH


def test_the_feed_it_opened_lasts_until_the_session_ends() -> None:
    minted = issue_ticket("admin-key", now=1000.2, session_seconds=600)
    assert minted.session_ends_at == 1601  # whole seconds, rounded up: never short
    assert session_end("admin-key", minted.ticket, now=minted.expires_at + 1) == 1601
    assert session_end("admin-key", minted.ticket, now=1600.9) == 1601
    assert session_end("admin-key", minted.ticket, now=1601) is None
    assert session_end("a-new-admin-key", minted.ticket, now=1001) is None  # the key changed


def test_a_session_shorter_than_the_ticket_also_ends_its_opening() -> None:
    minted = issue_ticket("admin-key", now=1000.0, session_seconds=2)
    assert minted.expires_at == minted.session_ends_at == 1002
    assert ticket_valid("admin-key", minted.ticket, now=1001.9)
    assert not ticket_valid("admin-key", minted.ticket, now=1002)
    with pytest.raises(ValueError):
        issue_ticket("admin-key", now=1000.0, session_seconds=0)


def test_a_ticket_is_bound_to_the_admin_key_and_cannot_be_altered() -> None:
    minted = issue_ticket("admin-key", now=1000.0)
    assert "admin-key" not in minted.ticket
    assert not ticket_valid("another-key", minted.ticket, now=1000.0)
    expires, ends, mac = minted.ticket.split(".")
    for altered in (
        f"{int(expires) + 3600}.{ends}.{mac}",  # opening extended
        f"{expires}.{int(ends) + 3600}.{mac}",  # session extended
        f"{expires}.{ends}.{mac.upper()}",
        f"{expires}.{ends}.{mac}.",
        f"0{expires}.{ends}.{mac}",
    ):
        assert not ticket_valid("admin-key", altered, now=1000.0), altered
        assert session_end("admin-key", altered, now=1000.0) is None, altered


@pytest.mark.parametrize(
    "junk",
    [
        "",
        ".",
        "..",
        "abc.def",
        "1e9.00",
        "-5.00",
        "9" * 20 + ".00",
        "².x",  # str.isdigit() says yes, int() says no: once a 500
        "²²²².²²²².x",
        "\uff11\uff12.\uff13\uff14." + "0" * 64,  # fullwidth digits
        "1.2." + "é" * 64,  # hmac.compare_digest refuses non-ASCII str: once a 500
        "1.2.\x00",
        "\udcff.1.2",  # a lone surrogate (bytes that were not UTF-8)
        "9" * 100_000,
    ],
)
def test_anything_but_an_ascii_ticket_is_simply_invalid(junk: str) -> None:
    assert not ticket_valid("admin-key", junk, now=1000.0)
    assert session_end("admin-key", junk, now=1000.0) is None
