"""Merging queued token chunks of one job into fewer messages before they are written."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from wire import control_pb2 as pb

log = logging.getLogger(__name__)

# Bounds on one merged TokenChunk, far below gRPC's default 4 MiB message limit.
MAX_MERGED_DELTAS = 4096
MAX_MERGED_TEXT = 256 * 1024  # characters of text and extras (at most 1 MiB of UTF-8)


def merge_token_chunks(messages: Iterable[pb.AgentMessage]) -> list[pb.AgentMessage]:
    """``messages`` in the same order, with each run of adjacent ``TokenChunk`` messages of
    one job merged into one (deltas concatenated in order, up to :data:`MAX_MERGED_DELTAS`
    deltas and :data:`MAX_MERGED_TEXT` characters). Nothing else is merged or reordered; the
    given messages are not modified."""
    merged: list[pb.AgentMessage] = []
    tail: pb.TokenChunk | None = None  # merged[-1]'s chunk while it may still grow
    owned = False  # whether merged[-1] is a copy made here (safe to extend)
    deltas = text = 0
    for message in messages:
        if message.WhichOneof("payload") != "token_chunk":
            merged.append(message)
            tail = None
            continue
        chunk = message.token_chunk
        size = sum(len(delta.text) + len(delta.extra_json) for delta in chunk.deltas)
        if (
            tail is not None
            and tail.job_id == chunk.job_id
            and deltas + len(chunk.deltas) <= MAX_MERGED_DELTAS
            and text + size <= MAX_MERGED_TEXT
        ):
            if not owned:
                copy = pb.AgentMessage()
                copy.CopyFrom(merged[-1])
                merged[-1] = copy
                tail = copy.token_chunk
                owned = True
            tail.deltas.extend(chunk.deltas)
            deltas += len(chunk.deltas)
            text += size
            continue
        merged.append(message)
        tail, owned, deltas, text = chunk, False, len(chunk.deltas), size
    return merged
