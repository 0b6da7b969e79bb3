"""Indexes of sets (``dict[key, set[member]]``) that keep no empty set: what the prefix index
and the slot ledger keep their reverse lookups in."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
M = TypeVar("M")


def discard(index: dict[K, set[M]], key: K, member: M) -> None:
    """Takes ``member`` out of ``index[key]``, and the key out once its set is empty."""
    members = index.get(key)
    if members is not None:
        members.discard(member)
        if not members:
            del index[key]
