"""An enrollment token as issued: minted (with its terms) and perhaps revoked.

The token itself is stateless (HMAC-signed claims, ``domain/enrollment_token.py``); this
aggregate records that it was minted, by whom and on which terms (multi-use is an explicit
choice, recorded here), so tokens can be listed and revoked. Its id derives from the token id.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypedDict
from uuid import NAMESPACE_URL, UUID, uuid5

from eventsourcing.domain import Aggregate

from domain.errors import IllegalTransition


def issued_token_id(token_id: str) -> UUID:
    return uuid5(NAMESPACE_URL, f"dacp:issued-token:{token_id}")


class TokenTerms(TypedDict):
    """A minted token's terms (:meth:`IssuedToken.mint`'s keywords), for a caller that passes
    them on: when it expires, whether it enrolls once, the node name it binds (None: any),
    and who minted it."""

    expires_at: float
    single_use: bool
    node_name: str | None
    minted_by: str


class IssuedToken(Aggregate):
    class Minted(Aggregate.Created):
        code: ClassVar[str] = "ENROLLMENT_TOKEN_MINTED"
        token_id: str
        expires_at: float
        single_use: bool
        node_name: str | None
        minted_by: str

    class Revoked(Aggregate.Event):
        code: ClassVar[str] = "ENROLLMENT_TOKEN_REVOKED"
        revoked_by: str
        reason: str

        def apply(self, aggregate: Any) -> None:
            aggregate.revoked = True

    def __init__(
        self,
        token_id: str,
        expires_at: float,
        single_use: bool,
        node_name: str | None,
        minted_by: str,
    ) -> None:
        self.token_id = token_id
        self.expires_at = expires_at
        self.single_use = single_use
        self.node_name = node_name
        self.minted_by = minted_by
        self.revoked = False

    @classmethod
    def mint(
        cls,
        token_id: str,
        *,
        expires_at: float,
        single_use: bool,
        node_name: str | None,
        minted_by: str,
    ) -> IssuedToken:
        return cls._create(
            cls.Minted,
            id=issued_token_id(token_id),
            token_id=token_id,
            expires_at=expires_at,
            single_use=single_use,
            node_name=node_name,
            minted_by=minted_by,
        )

    def revoke(self, revoked_by: str, reason: str) -> None:
        if self.revoked:
            raise IllegalTransition("token", "revoke", "REVOKED", "already revoked")
        self.trigger_event(self.Revoked, revoked_by=revoked_by, reason=reason)
