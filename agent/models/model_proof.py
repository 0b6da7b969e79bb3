"""Proving to the controller that this node holds a model file it reports (``ProveModel``).

The controller names a file by its sha256, a nonce and byte ranges it picked at random; the
agent answers ``ModelProof`` with ``sha256(nonce || bytes)`` of each range, read from the file
in its models directory whose cached sha256 is the one named (nothing is hashed whole again:
the hash cache knows it while the file's size and mtime are unchanged). A node that cannot
answer is never that model's primary.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from agent.control.control_handler import Send
from agent.models.model_store import ModelStore
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

#: What a challenge may ask, at most: no controller asks this much, and a bigger one is
#: refused instead of read.
MAX_RANGES = 256
MAX_RANGE_BYTES = 1 << 20
MAX_NONCE_BYTES = 64


def answer(store: ModelStore, challenge: pb.ProveModel) -> pb.ModelProof:
    """The answer to ``challenge`` from the file ``store`` holds (an error when it has none)."""
    proof = pb.ModelProof(challenge_id=challenge.challenge_id, model_sha256=challenge.model_sha256)
    if len(challenge.ranges) > MAX_RANGES or len(challenge.nonce) > MAX_NONCE_BYTES:
        proof.error = "the challenge asks for more than a proof needs"
        return proof
    if any(r.length > MAX_RANGE_BYTES for r in challenge.ranges):
        proof.error = f"a range is longer than {MAX_RANGE_BYTES} bytes"
        return proof
    path = store.cached_path(challenge.model_sha256)
    if path is None:
        proof.error = "no file with that sha256 here (or it changed since it was hashed)"
        return proof
    try:
        before = path.stat()
        digests = []
        with path.open("rb") as handle:
            for r in challenge.ranges:
                handle.seek(r.offset)
                data = handle.read(r.length)
                if len(data) != r.length:
                    proof.error = f"the range at {r.offset} goes beyond the file"
                    return proof
                digests.append(hashlib.sha256(challenge.nonce + data).digest())
        after = path.stat()
    except OSError as e:
        proof.error = f"cannot read {path.name}: {e.strerror or e}"
        return proof
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        proof.error = f"{path.name} changed while it was read"
        return proof
    proof.digests.extend(digests)
    return proof


async def prove(store: ModelStore, challenge: pb.ProveModel, send: Send) -> None:
    """Answers ``challenge`` (reading the disk in a worker thread)."""
    proof = await asyncio.to_thread(answer, store, challenge)
    if proof.error:
        log.warning("cannot prove model %s: %s", challenge.model_sha256[:12], proof.error)
    await send(pb.AgentMessage(model_proof=proof))
