"""Feed tickets: valid for their time, under their admin key, and nothing else."""

from __future__ import annotations

from application.feed_tickets import TICKET_TTL, issue_ticket, ticket_valid


def test_a_ticket_opens_the_feed_until_it_expires() -> None:
    ticket, expires_at = issue_ticket("admin-key", now=1000.0)
    assert expires_at == 1000 + int(TICKET_TTL)
    assert ticket_valid("admin-key", ticket, now=1000.0)
    assert ticket_valid("admin-key", ticket, now=expires_at - 0.5)
    assert not ticket_valid("admin-key", ticket, now=expires_at)


def test_a_ticket_is_bound_to_the_admin_key_and_cannot_be_altered() -> None:
    ticket, expires_at = issue_ticket("admin-key", now=1000.0)
    assert "admin-key" not in ticket
    assert not ticket_valid("another-key", ticket, now=1000.0)
    mac = ticket.partition(".")[2]
    assert not ticket_valid("admin-key", f"{expires_at + 3600}.{mac}", now=1000.0)  # extended
    for junk in ("", ".", "abc.def", "1e9.00", "-5.00", "9" * 20 + ".00"):
        assert not ticket_valid("admin-key", junk, now=1000.0)
