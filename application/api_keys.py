"""The key book: managed inference keys (issue 25) created, changed, revoked and checked.

A key's text is shown once, by :meth:`KeyBook.create`; the store records only its sha256.
:meth:`KeyBook.check` loads the key's aggregate from the event store on every call (no cache
of its own: the repository fast-forwards what it holds from the store), so a revocation that
any controller sharing the store recorded fails the key at once everywhere. Listing reads the
``api_keys`` views (:class:`~application.ports.ApiKeyViews`), which never hold the hash.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

from eventsourcing.domain import Aggregate

from application.controller import Controller
from application.errors import NotFound
from application.ports import ApiKeyViews
from domain.api_key import ApiKey, KeyChanges, key_id_of, key_sha256, key_text
from domain.api_keys import NO_LIMITS, Grant, KeyLimits, Priority

#: The random part of a key: ``secrets.token_urlsafe(32)`` (43 characters).
SECRET_BYTES = 32


def new_secret() -> str:
    return secrets.token_urlsafe(SECRET_BYTES)


@dataclass(frozen=True)
class NewKey:
    """A key just created: its id, its text (shown once, never again) and where its
    API_KEY_CREATED reached in the store."""

    key_id: str
    key: str
    position: int


def is_live(row: dict[str, Any], now: datetime) -> bool:
    """Whether an ``api_keys`` row is neither revoked nor expired at ``now``."""
    if row.get("revoked"):
        return False
    expires = row.get("expires_at")
    return expires is None or now < datetime.fromisoformat(str(expires))


class KeyBook:
    """Managed keys over the controller's store (commands) and its views (listing)."""

    def __init__(
        self,
        app: Controller,
        views: ApiKeyViews,
        *,
        secret: Callable[[], str] = new_secret,
        new_id: Callable[[], UUID] = uuid4,
    ) -> None:
        self.app = app
        self.views = views
        self._secret = secret
        self._new_id = new_id

    # ------------------------------------------------------------- commands

    def create(
        self,
        name: str,
        *,
        owner: str = "",
        models: list[str] | None = None,
        limits: KeyLimits = NO_LIMITS,
        priority: Priority | str = Priority.INTERACTIVE,
        expires_at: datetime | None = None,
    ) -> NewKey:
        """API_KEY_CREATED; by default the key may use every model, without limits, as
        interactive. Raises ``InvalidCommand`` for bad terms."""
        key_id = self._new_id()
        text = key_text(key_id, self._secret())
        key = ApiKey.create(
            key_id,
            key_sha256(text),
            name,
            owner=owner,
            models=models,
            limits=limits,
            priority=priority,
            expires_at=expires_at,
        )
        position = self.app.aggregates.run(lambda: [key])
        return NewKey(str(key_id), text, position)

    def change(self, key_id: UUID | str, changes: KeyChanges) -> int:
        """API_KEY_CHANGED with what differs (nothing when nothing does): the store
        position. NotFound for an unknown key, IllegalTransition for a revoked one."""
        return self._command(key_id, lambda key: key.change(changes))

    def revoke(self, key_id: UUID | str, reason: str, revoked_by: str) -> int:
        """API_KEY_REVOKED: the key fails from now on, on every controller."""
        return self._command(key_id, lambda key: key.revoke(reason, revoked_by))

    def _command(self, key_id: UUID | str, act: Callable[[ApiKey], object]) -> int:
        def command() -> list[Aggregate]:
            key = self.app.aggregates.get(ApiKey, key_id)
            act(key)
            return [key]

        return self.app.aggregates.run(command)

    # -------------------------------------------------------------- queries

    def check(self, key: str, now: datetime) -> Grant | None:
        """What ``key`` allows at ``now``: its Grant, or None when it is no managed key,
        unknown, wrong, revoked or expired. Reads the store (blocking)."""
        key_id = key_id_of(key)
        if key_id is None:
            return None
        try:
            aggregate = self.app.aggregates.get(ApiKey, key_id)
        except NotFound:
            return None
        if not hmac.compare_digest(aggregate.key_sha256, key_sha256(key)):
            return None
        return aggregate.grant(now)

    def any_live(self, now: datetime) -> bool:
        """Whether some managed key works at ``now`` (then the cluster is not open)."""
        return any(is_live(row, now) for row in self.views.list_api_keys())

    def list(self) -> list[dict[str, Any]]:
        return self.views.list_api_keys()

    def get(self, key_id: str) -> dict[str, Any] | None:
        return self.views.get_api_key(key_id)
