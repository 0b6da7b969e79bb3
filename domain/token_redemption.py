"""Single-use enrollment tokens: a redemption is an aggregate whose id derives from the token.

Creating a second redemption for the same token collides on the aggregate's first version,
so the event store itself refuses reuse, even with two controllers racing.
"""

from __future__ import annotations

from typing import ClassVar
from uuid import NAMESPACE_URL, UUID, uuid5

from eventsourcing.domain import Aggregate


def redemption_id(token_id: str) -> UUID:
    return uuid5(NAMESPACE_URL, f"dacp:enrollment-token:{token_id}")


class TokenRedemption(Aggregate):
    class Redeemed(Aggregate.Created):
        code: ClassVar[str] = "ENROLLMENT_TOKEN_REDEEMED"
        token_id: str
        node_id: str

    def __init__(self, token_id: str, node_id: str) -> None:
        self.token_id = token_id
        self.node_id = node_id

    @classmethod
    def redeem(cls, token_id: str, node_id: str) -> TokenRedemption:
        return cls._create(
            cls.Redeemed, id=redemption_id(token_id), token_id=token_id, node_id=node_id
        )
