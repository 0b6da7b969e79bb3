"""What a node may claim about a model file, and how it proves it holds one (pure rules).

A registered model's *facts* (the file's size and shape: what the planner sizes a plan by)
come from the controller, never from a node's word:

- the controller's model store (``MODEL_STORED``: read from its own copy), else
- the first node that proved it holds the file, when only nodes hold it (``MODEL_SHAPE_FIXED``
  with that node's id); a revoked node's facts count for nothing, and the next proof fixes
  them again.

A node's claim (its ``ResourceReport`` entry for a registered sha256) that disagrees with the
facts is refused. One that agrees is not believed either: the node answers a *challenge*, the
sha256 of ``nonce || bytes`` for byte ranges the controller picks at random. The controller
checks the answers against its own copy when its store holds the file, else against the
*samples* (ranges, nonce and answers) recorded with the facts: the first proof's answers, or
ranges of the store's copy read while the controller had it. Until a claim is proven against
the model's current facts (its *basis*), the node is not that model's primary.

No I/O and no randomness here: callers pass random numbers in.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from domain.bounded_text import bounded

#: A model file's facts, in a shape dict (``MODEL_STORED``, ``MODEL_SHAPE_FIXED``) and in a
#: node's claim (its ``local_models`` entry).
FACT_KEYS = ("size_bytes", "layers", "context_length", "kv_bytes_per_token", "architecture")
#: The basis of facts read from the controller's model store (else: the fixing node's id).
STORE = "store"

#: Ranges of a fresh challenge against the controller's own copy.
CHALLENGE_RANGES = 16
#: Ranges recorded as samples (a first proof, or the store's copy); a challenge against
#: samples asks for CHALLENGE_RANGES of them.
SAMPLE_RANGES = 64
#: Bytes per range (less when the file is smaller).
RANGE_BYTES = 4096
NONCE_BYTES = 16
DIGEST_BYTES = 32

#: Sanity bounds of a shape a node fixes (a first proof): beyond them no file is real.
MAX_FILE_BYTES = 1 << 44  # 16 TiB
MAX_LAYERS = 4096
MAX_CONTEXT_LENGTH = 1 << 24
MAX_KV_BYTES_PER_TOKEN = 64 << 20
MAX_ARCHITECTURE_CHARS = 64

#: Draws a random integer in ``[0, n)``.
RandomBelow = Callable[[int], int]


#: The most characters of a node's text (a file or architecture name) a record keeps.
MAX_RECORDED_CHARS = 256


def recordable(text: object, limit: int = MAX_RECORDED_CHARS) -> str:
    """A node's text as it may be recorded (:func:`domain.bounded_text.bounded`: a NUL
    would break the views, a megabyte the record)."""
    return bounded(str(text), limit)


def facts_of(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The facts a shape or a claim states (missing numbers are 0, a missing name ""), in a
    form that may be recorded."""
    return {
        "size_bytes": int(entry.get("size_bytes") or 0),
        "layers": int(entry.get("layers") or 0),
        "context_length": int(entry.get("context_length") or 0),
        "kv_bytes_per_token": int(entry.get("kv_bytes_per_token") or 0),
        "architecture": recordable(entry.get("architecture") or ""),
    }


def disagreement(claim: Mapping[str, Any], facts: Mapping[str, Any]) -> str | None:
    """Why a node's claim of a file is refused: what it states differently from the facts
    (None: it agrees on every fact)."""
    said, known = facts_of(claim), facts_of(facts)
    wrong = [
        f"{key} {said[key]!r}, not {known[key]!r}" for key in FACT_KEYS if said[key] != known[key]
    ]
    if not wrong:
        return None
    return "it claims " + ", ".join(wrong) + " (the model's registered facts)"


def implausible(claim: Mapping[str, Any]) -> str | None:
    """Why a claim cannot fix a model's facts (None: it may): no real file has that shape."""
    facts = facts_of(claim)
    if not 0 < facts["size_bytes"] <= MAX_FILE_BYTES:
        return f"it claims a size of {facts['size_bytes']} bytes"
    if not 0 < facts["layers"] <= MAX_LAYERS:
        return f"it claims {facts['layers']} layers"
    if not 0 < facts["context_length"] <= MAX_CONTEXT_LENGTH:
        return f"it claims a context length of {facts['context_length']}"
    if not 0 <= facts["kv_bytes_per_token"] <= MAX_KV_BYTES_PER_TOKEN:
        return f"it claims {facts['kv_bytes_per_token']} bytes of KV cache per token"
    if len(facts["architecture"]) > MAX_ARCHITECTURE_CHARS:
        return "it claims an architecture name too long to be one"
    return None


@dataclass(frozen=True, slots=True)
class ByteRange:
    offset: int
    length: int


def pick_ranges(size: int, count: int, below: RandomBelow) -> tuple[ByteRange, ...]:
    """``count`` ranges of up to RANGE_BYTES at random offsets inside a file of ``size``
    bytes (the whole file when it is smaller than one range)."""
    if size <= 0:
        raise ValueError("a file to prove has at least one byte")
    length = min(RANGE_BYTES, size)
    return tuple(ByteRange(below(size - length + 1), length) for _ in range(count))


def pick_samples(count: int, total: int, below: RandomBelow) -> tuple[int, ...]:
    """``min(count, total)`` distinct indexes out of ``total``, at random."""
    pool = list(range(total))
    chosen = []
    for _ in range(min(count, total)):
        chosen.append(pool.pop(below(len(pool))))
    return tuple(chosen)


def range_digest(nonce: bytes, data: bytes) -> bytes:
    """What a node answers for one range: ``sha256(nonce || the range's bytes)``."""
    return hashlib.sha256(nonce + data).digest()


def wrong_answers(expected: Sequence[bytes], answered: Sequence[bytes]) -> str | None:
    """Why an answer to a challenge fails (None: every digest is right)."""
    if len(answered) != len(expected):
        return f"it answered {len(answered)} digest(s) for {len(expected)} range(s)"
    bad = sum(not hmac.compare_digest(e, a) for e, a in zip(expected, answered, strict=True))
    if bad:
        return f"{bad} of its {len(expected)} range digest(s) are not the file's"
    return None


def malformed_answer(ranges: int, answered: Sequence[bytes]) -> str | None:
    """Why an answer cannot even be a proof (None: it has the form of one)."""
    if len(answered) != ranges:
        return f"it answered {len(answered)} digest(s) for {ranges} range(s)"
    if any(len(d) != DIGEST_BYTES for d in answered):
        return "its digests are not sha256 digests"
    return None


@dataclass(frozen=True, slots=True)
class Samples:
    """Ranges of a model's file with their digests under ``nonce``, known to be right (the
    store's copy) or taken as right (the first proof): what a challenge is checked against
    when the controller has no copy."""

    nonce: bytes
    ranges: tuple[ByteRange, ...]
    digests: tuple[bytes, ...]

    def to_event(self) -> tuple[str, list[list[Any]]]:
        """(nonce hex, [[offset, length, digest hex], ...]) as events record them."""
        return self.nonce.hex(), [
            [r.offset, r.length, d.hex()] for r, d in zip(self.ranges, self.digests, strict=True)
        ]

    @classmethod
    def from_event(cls, nonce: str, samples: Sequence[Sequence[Any]]) -> Samples:
        return cls(
            bytes.fromhex(nonce),
            tuple(ByteRange(int(s[0]), int(s[1])) for s in samples),
            tuple(bytes.fromhex(str(s[2])) for s in samples),
        )

    def subset(self, indexes: Sequence[int]) -> Samples:
        return Samples(
            self.nonce,
            tuple(self.ranges[i] for i in indexes),
            tuple(self.digests[i] for i in indexes),
        )
