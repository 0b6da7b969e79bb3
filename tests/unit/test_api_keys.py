"""Managed inference keys: the ApiKey aggregate (domain/api_key.py) and the key book
(application/api_keys.py) on an in-memory event store, with views projected from its log."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import pytest
from hypothesis import given
from hypothesis import strategies as st

from application.api_keys import KeyBook, is_live
from application.controller import Controller
from application.errors import NotFound
from application.read_models import project_api_key
from application.timeline import job_timeline, payload_of
from domain.api_key import KEY_PREFIX, ApiKey, key_id_of, key_sha256, key_text
from domain.api_keys import KeyLimits, Priority
from domain.catalog import CATALOG, code_of
from domain.errors import IllegalTransition, InvalidCommand

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
SHA = "a" * 64


class KeyViews:
    """The ``api_keys`` views over the application's log, caught up on every query."""

    def __init__(self, app: Controller) -> None:
        self.app = app
        self.rows: dict[str, dict[str, Any]] = {}
        self.position = 0

    def _catch_up(self) -> None:
        for notification in self.app.recorder.select_notifications(self.position + 1, 1000):
            event = self.app.mapper.to_domain_event(notification)
            ident = str(event.originator_id)
            row = project_api_key(self.rows.get(ident), event)
            if row is not None:
                self.rows[ident] = row
            self.position = notification.id

    def list_api_keys(self) -> list[dict[str, Any]]:
        self._catch_up()
        return sorted(self.rows.values(), key=lambda r: r["created_at"], reverse=True)

    def get_api_key(self, key_id: str) -> dict[str, Any] | None:
        self._catch_up()
        return self.rows.get(key_id)


@pytest.fixture
def app() -> Controller:
    return Controller()


@pytest.fixture
def book(app: Controller) -> KeyBook:
    return KeyBook(app, KeyViews(app))


# ------------------------------------------------------------------ the aggregate


def test_events_have_catalog_codes() -> None:
    key = ApiKey.create(uuid4(), SHA, "team a")
    key.change({"name": "team b"})
    key.revoke("left", "admin")
    codes = [code_of(e) for e in key.collect_events()]
    assert codes == ["API_KEY_CREATED", "API_KEY_CHANGED", "API_KEY_REVOKED"]
    assert all(CATALOG[c] is not None for c in codes)


def test_a_key_made_with_only_a_name_allows_everything() -> None:
    key = ApiKey.create(uuid4(), SHA, "team a")
    grant = key.grant(NOW)
    assert grant is not None
    assert (grant.key_id, grant.name, grant.models) == (str(key.id), "team a", None)
    assert grant.limits.unlimited() and grant.priority is Priority.INTERACTIVE
    assert grant.may_use("anything")


def test_terms_reach_the_grant() -> None:
    limits = KeyLimits(requests_per_minute=60, monthly_tokens=1_000_000)
    key = ApiKey.create(
        uuid4(),
        SHA,
        "batch",
        owner="ml team",
        models=["m2", "m1", "m1"],
        limits=limits,
        priority="batch",
        expires_at=NOW + timedelta(days=1),
    )
    assert key.models == ["m1", "m2"]
    grant = key.grant(NOW)
    assert grant is not None
    assert grant.models == frozenset({"m1", "m2"}) and not grant.may_use("m3")
    assert (grant.limits, grant.priority) == (limits, Priority.BATCH)


@pytest.mark.parametrize(
    ("terms", "says"),
    [
        ({"name": " "}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": "a\x00b"}, "name"),
        ({"name": ""}, "name"),
        ({"owner": "a\nb"}, "owner"),
        ({"limits": KeyLimits(monthly_tokens=10**16)}, "monthly_tokens"),
        ({"models": []}, "at least one model"),
        ({"models": ["bad name!"]}, "not a model name"),
        ({"limits": KeyLimits(requests_per_minute=0)}, "requests_per_minute"),
        ({"limits": KeyLimits(tokens_per_minute=-5)}, "tokens_per_minute"),
        ({"limits": KeyLimits(concurrent_requests=True)}, "concurrent_requests"),
        ({"priority": "urgent"}, "priority"),
        ({"expires_at": datetime(2026, 1, 1)}, "time zone"),
    ],
)
def test_bad_terms_are_refused(terms: dict[str, Any], says: str) -> None:
    args: dict[str, Any] = {"name": "ok", **terms}
    name = args.pop("name")
    with pytest.raises(InvalidCommand, match=says):
        ApiKey.create(uuid4(), SHA, name, **args)
    key = ApiKey.create(uuid4(), SHA, "ok")
    with pytest.raises(InvalidCommand, match=says):
        key.change({"name": name, **args} if name != "ok" else args)  # type: ignore[arg-type, typeddict-item]
    assert len(key.collect_events()) == 1  # nothing recorded


def test_a_bad_hash_is_refused() -> None:
    with pytest.raises(InvalidCommand):
        ApiKey.create(uuid4(), "A" * 64, "x")


def test_change_records_only_what_differs() -> None:
    key = ApiKey.create(uuid4(), SHA, "a", owner="o")
    assert key.change({"name": "a", "owner": "o"}) is False
    assert key.change({"name": "b", "owner": "o", "expires_at": NOW}) is True
    changed = key.collect_events()[-1]
    assert isinstance(changed, ApiKey.Changed)
    assert changed.changes == {"name": "b", "expires_at": NOW.isoformat()}
    key.change({"expires_at": None, "models": ["m"]})
    assert (key.expires_at, key.models) == (None, ["m"])
    key.change({"models": None})
    assert key.models is None


def test_a_revoked_key_cannot_change_or_grant() -> None:
    key = ApiKey.create(uuid4(), SHA, "a")
    key.revoke("leaked", "admin")
    assert key.grant(NOW) is None
    with pytest.raises(IllegalTransition):
        key.change({"name": "b"})
    with pytest.raises(IllegalTransition):
        key.revoke("again", "admin")


def test_an_expired_key_grants_nothing() -> None:
    key = ApiKey.create(uuid4(), SHA, "a", expires_at=NOW)
    assert key.grant(NOW - timedelta(seconds=1)) is not None
    assert key.grant(NOW) is None


@given(st.uuids(), st.text(alphabet="abcXYZ019_-", min_size=16, max_size=64))
def test_key_text_names_its_id(key_id: UUID, secret: str) -> None:
    text = key_text(key_id, secret)
    assert text.startswith(KEY_PREFIX)
    assert key_id_of(text) == key_id


@pytest.mark.parametrize(
    "text",
    ["", "sk-dacp-", "sk-dacp-" + "0" * 32, "sk-dacp-" + "g" * 32 + "x" * 43, "bearer-token"],
)
def test_other_texts_name_no_key(text: str) -> None:
    assert key_id_of(text) is None


# ------------------------------------------------------------------- the key book


def test_create_and_check(book: KeyBook) -> None:
    new = book.create("team a")
    assert new.key.startswith(KEY_PREFIX + UUID(new.key_id).hex)
    assert len(new.key) == len(KEY_PREFIX) + 32 + 43
    grant = book.check(new.key, NOW)
    assert grant is not None and grant.key_id == new.key_id and grant.name == "team a"


def test_keys_are_random(book: KeyBook) -> None:
    assert book.create("a").key[-43:] != book.create("b").key[-43:]


def test_the_key_is_recorded_only_as_its_hash(app: Controller, book: KeyBook) -> None:
    new = book.create("team a")
    events = list(app.events.get(UUID(new.key_id)))
    assert events[0].key_sha256 == key_sha256(new.key)  # type: ignore[attr-defined]
    secret = new.key[len(KEY_PREFIX) + 32 :]
    for notification in app.recorder.select_notifications(1, 100):
        assert secret.encode() not in notification.state
    row = book.get(new.key_id)
    assert row is not None and "key_sha256" not in row and new.key not in str(row)
    assert payload_of(events[0])["key_sha256"] == "<redacted>"


@pytest.mark.parametrize("how", ["wrong secret", "unknown id", "not a key", "job id"])
def test_wrong_keys_fail(app: Controller, book: KeyBook, how: str) -> None:
    new = book.create("team a")
    key_id = UUID(new.key_id)
    wrong = {
        "wrong secret": key_text(key_id, "x" * 43),
        "unknown id": key_text(uuid4(), new.key[-43:]),
        "not a key": "hunter2",
        "job id": key_text(_a_job(app), new.key[-43:]),
    }[how]
    assert book.check(wrong, NOW) is None


def _a_job(app: Controller) -> UUID:
    from application.commands import ChatPrompt, JobParams, Submission

    result = app.submit(
        Submission("m", ChatPrompt([{"role": "user", "content": "hi"}]), JobParams())
    )
    assert result.aggregate_id is not None
    assert job_timeline(app, result.aggregate_id)  # a job, not a key
    return result.aggregate_id


def test_revocation_fails_the_key_at_once(book: KeyBook) -> None:
    new = book.create("team a")
    assert book.check(new.key, NOW) is not None
    book.revoke(new.key_id, "leaked", "admin")
    assert book.check(new.key, NOW) is None
    row = book.get(new.key_id)
    assert row is not None and row["revoked"] and row["revoke_reason"] == "leaked"


def test_a_second_book_on_the_same_store_sees_the_revocation(app: Controller) -> None:
    """Two books over one application (its repository cache included): the second one
    checked the key before, and still sees the revocation the first recorded."""
    first, second = KeyBook(app, KeyViews(app)), KeyBook(app, KeyViews(app))
    new = first.create("a")
    assert second.check(new.key, NOW) is not None
    first.revoke(new.key_id, "gone", "admin")
    assert second.check(new.key, NOW) is None


def test_change_through_the_book(book: KeyBook) -> None:
    new = book.create("a", models=["m1"])
    book.change(new.key_id, {"models": ["m2"], "limits": KeyLimits(concurrent_requests=2)})
    grant = book.check(new.key, NOW)
    assert grant is not None
    assert grant.models == frozenset({"m2"}) and grant.limits.concurrent_requests == 2
    row = book.get(new.key_id)
    assert row is not None and row["models"] == ["m2"]
    assert row["limits"]["concurrent_requests"] == 2


def test_unknown_keys_are_not_found(book: KeyBook) -> None:
    with pytest.raises(NotFound, match="unknown api_key"):
        book.revoke(str(uuid4()), "x", "admin")
    with pytest.raises(NotFound):
        book.change("not-an-id", {"name": "x"})


def test_any_live(book: KeyBook) -> None:
    assert not book.any_live(NOW)
    expiring = book.create("a", expires_at=NOW + timedelta(hours=1))
    assert book.any_live(NOW)
    assert not book.any_live(NOW + timedelta(hours=1))
    book.revoke(expiring.key_id, "x", "admin")
    assert not book.any_live(NOW)
    assert not is_live({"revoked": False, "expires_at": NOW.isoformat()}, NOW)
    assert is_live({"revoked": False, "expires_at": None}, NOW)
