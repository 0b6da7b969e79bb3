"""The ApiKey aggregate: one managed inference key, its terms and their history (issue 25).

A key is ``sk-dacp-`` + the aggregate's id (32 hex digits) + a random secret. Only the sha256
of the whole key is recorded (API_KEY_CREATED's ``key_sha256``): the key itself is shown once,
when it is created, and nowhere else. Checking a key parses its id, loads the aggregate and
compares hashes, so a revocation counts from the moment it is recorded.

What a checked key allows a request is a :class:`~domain.api_keys.Grant`
(:meth:`ApiKey.grant`); the value types are in :mod:`domain.api_keys`. Pure: times are given.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from typing import Any, ClassVar, TypedDict
from uuid import UUID

from eventsourcing.domain import Aggregate

from domain.api_keys import NO_LIMITS, Grant, KeyLimits, Priority
from domain.errors import IllegalTransition, InvalidCommand
from domain.model import is_model_name

#: What every managed key begins with.
KEY_PREFIX = "sk-dacp-"
#: The longest name and owner of a key (characters).
KEY_NAME_MAX = 100
#: A key's name: no control characters, and at least one that is not a space (the HTTP API
#: documents these patterns; JSON Schema flavour). An owner may be empty.
KEY_NAME_PATTERN = r"^[^\x00-\x1f\x7f]*[^\x00-\x20\x7f][^\x00-\x1f\x7f]*$"
KEY_OWNER_PATTERN = r"^[^\x00-\x1f\x7f]*$"
#: The most models a key may name.
KEY_MODELS_MAX = 256
#: The largest value of any limit (well inside JSON's exact integers).
KEY_LIMIT_MAX = 10**15
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(KEY_NAME_PATTERN)
_OWNER = re.compile(KEY_OWNER_PATTERN)
_KEY = re.compile(re.escape(KEY_PREFIX) + r"([0-9a-f]{32})([A-Za-z0-9_-]{16,128})")
#: The fields API_KEY_CHANGED may carry, in the order they are shown.
CHANGEABLE = ("name", "owner", "models", "limits", "priority", "expires_at")


def key_text(key_id: UUID, secret: str) -> str:
    """The key as its holder sends it."""
    return f"{KEY_PREFIX}{key_id.hex}{secret}"


def key_id_of(key: str) -> UUID | None:
    """The id a key names, or None when ``key`` is not of the managed form."""
    match = _KEY.fullmatch(key)
    return UUID(hex=match.group(1)) if match else None


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyChanges(TypedDict, total=False):
    """What :meth:`ApiKey.change` changes: only the fields given (``models`` None: every
    model; ``expires_at`` None: never)."""

    name: str
    owner: str
    models: list[str] | None
    limits: KeyLimits
    priority: Priority
    expires_at: datetime | None


def _name(name: str) -> str:
    if not isinstance(name, str) or len(name) > KEY_NAME_MAX or not _NAME.fullmatch(name):
        raise InvalidCommand(
            f"a key's name must not be empty: at most {KEY_NAME_MAX} characters, not only "
            "spaces, none a control character"
        )
    return name


def _owner(owner: str) -> str:
    if not isinstance(owner, str) or len(owner) > KEY_NAME_MAX or not _OWNER.fullmatch(owner):
        raise InvalidCommand(
            f"a key's owner is at most {KEY_NAME_MAX} characters, none a control character"
        )
    return owner


def _models(models: list[str] | None) -> list[str] | None:
    if models is None:
        return None
    if not models:
        raise InvalidCommand("models must name at least one model (leave it out for every model)")
    if len(models) > KEY_MODELS_MAX:
        raise InvalidCommand(f"a key names at most {KEY_MODELS_MAX} models")
    for model in models:
        if not isinstance(model, str) or not is_model_name(model):
            raise InvalidCommand(f"{model!r} is not a model name")
    return sorted(set(models))


def _limits(limits: KeyLimits) -> dict[str, int | None]:
    recorded = limits.recorded()
    for field, value in recorded.items():
        if value is not None and (type(value) is not int or not 0 < value <= KEY_LIMIT_MAX):
            raise InvalidCommand(
                f"limits.{field} must be a positive integer (at most {KEY_LIMIT_MAX}), "
                f"got {value!r}"
            )
    return recorded


def _priority(priority: Priority | str) -> str:
    try:
        return Priority(priority).value
    except ValueError:
        names = ", ".join(p.value for p in Priority)
        raise InvalidCommand(f"priority must be one of {names}, got {priority!r}") from None


def _expiry(expires_at: datetime | None) -> str | None:
    if expires_at is None:
        return None
    if expires_at.tzinfo is None:
        raise InvalidCommand("expires_at must say its time zone (e.g. 2026-01-31T00:00:00Z)")
    return expires_at.isoformat()


def recorded_change(changes: KeyChanges) -> dict[str, Any]:
    """``changes`` validated, as API_KEY_CHANGED records them."""
    out: dict[str, Any] = {}
    if "name" in changes:
        out["name"] = _name(changes["name"])
    if "owner" in changes:
        out["owner"] = _owner(changes["owner"])
    if "models" in changes:
        out["models"] = _models(changes["models"])
    if "limits" in changes:
        out["limits"] = _limits(changes["limits"])
    if "priority" in changes:
        out["priority"] = _priority(changes["priority"])
    if "expires_at" in changes:
        out["expires_at"] = _expiry(changes["expires_at"])
    return out


class ApiKey(Aggregate):
    """A managed inference key. Its id is the one the key text carries."""

    class Event(Aggregate.Event):
        code: ClassVar[str] = ""

    class Created(Aggregate.Created):
        code: ClassVar[str] = "API_KEY_CREATED"
        name: str
        owner: str
        key_sha256: str
        #: None: every model.
        models: list[str] | None
        #: ``KeyLimits.recorded()``.
        limits: dict[str, int | None]
        priority: str
        #: ISO 8601 with its zone; None: never.
        expires_at: str | None

    class Changed(Event):
        """The terms that changed, and only those (keys of :data:`CHANGEABLE`)."""

        code: ClassVar[str] = "API_KEY_CHANGED"
        changes: dict[str, Any]

        def apply(self, aggregate: Any) -> None:
            for field, value in self.changes.items():
                setattr(aggregate, field, value)

    class Revoked(Event):
        code: ClassVar[str] = "API_KEY_REVOKED"
        reason: str
        revoked_by: str

        def apply(self, aggregate: Any) -> None:
            aggregate.revoked = True

    def __init__(
        self,
        name: str,
        owner: str,
        key_sha256: str,
        models: list[str] | None,
        limits: dict[str, int | None],
        priority: str,
        expires_at: str | None,
    ) -> None:
        self.name = name
        self.owner = owner
        self.key_sha256 = key_sha256
        self.models = models
        self.limits = limits
        self.priority = priority
        self.expires_at = expires_at
        self.revoked = False

    @classmethod
    def create(
        cls,
        key_id: UUID,
        key_sha256: str,
        name: str,
        *,
        owner: str = "",
        models: list[str] | None = None,
        limits: KeyLimits = NO_LIMITS,
        priority: Priority | str = Priority.INTERACTIVE,
        expires_at: datetime | None = None,
    ) -> ApiKey:
        """API_KEY_CREATED: a key with these terms (by default every model, no limits,
        interactive, never expiring), known by the sha256 of its text."""
        if not _SHA256.fullmatch(key_sha256):
            raise InvalidCommand("key_sha256 must be 64 lowercase hex digits")
        return cls._create(
            cls.Created,
            id=key_id,
            name=_name(name),
            owner=_owner(owner),
            key_sha256=key_sha256,
            models=_models(models),
            limits=_limits(limits),
            priority=_priority(priority),
            expires_at=_expiry(expires_at),
        )

    def change(self, changes: KeyChanges) -> bool:
        """API_KEY_CHANGED with the fields that differ; False (nothing recorded) when none
        does. A revoked key changes no more."""
        if self.revoked:
            raise IllegalTransition("api key", "change", "REVOKED", "a revoked key stays revoked")
        wanted = recorded_change(changes)
        differ = {k: v for k, v in wanted.items() if getattr(self, k) != v}
        if not differ:
            return False
        self.trigger_event(self.Changed, changes=differ)
        return True

    def revoke(self, reason: str, revoked_by: str) -> None:
        """API_KEY_REVOKED: the key works no more, for good."""
        if self.revoked:
            raise IllegalTransition("api key", "revoke", "REVOKED", "already revoked")
        self.trigger_event(self.Revoked, reason=reason, revoked_by=revoked_by)

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= datetime.fromisoformat(self.expires_at)

    def grant(self, now: datetime) -> Grant | None:
        """What the key allows a request at ``now``; None when revoked or expired."""
        if self.revoked or self.expired(now):
            return None
        return Grant(
            key_id=str(self.id),
            name=self.name,
            models=None if self.models is None else frozenset(self.models),
            limits=KeyLimits(**self.limits),
            priority=Priority(self.priority),
        )
