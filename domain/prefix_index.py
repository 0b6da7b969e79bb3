"""What each warm server's slots hold in their KV cache, approximately, so that a conversation's
next turn goes back to the server (and slot) that already holds its prefix.

llama-server keeps each slot's KV cache after a request ends (``cache_prompt``), and a prompt
that extends what a slot holds only pays for its new tokens. The controller cannot see those
caches; it remembers what it sent instead:

* A prompt's *prefix chain* (:func:`prefix_chain`) hashes its canonical text in blocks of
  :data:`BLOCK_CHARS` characters, each hash covering every block before it (``h[i]`` stands for
  the first ``i + 1`` blocks). Two prompts share their first ``k`` hashes exactly when they
  share their first ``k`` blocks (up to a 64-bit collision), so a match needs no text kept.
* :class:`PrefixIndex` keeps, per server slot, the chain of the last prompt dispatched there,
  placed in the slot llama-server itself would pick (the idle slot sharing the longest prefix,
  else the one used longest ago): a slot holds one conversation at a time, so recording a new
  prompt on a slot ages out what it held. A server that stops or is lost is forgotten whole.
  The agent does not name the slot (``id_slot``): llama-server already picks the idle slot with
  the longest common prefix, and a named slot that is busy would make the request wait.
* :func:`prefix_route` picks the server holding the longest prefix unless it is loaded beyond
  the bound of consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
  2018), plus one job of slack: a server may take a job only while its running jobs stay
  within ``ceil((1 + epsilon) * (running + 1) / servers) + 1``, so no server takes more than
  ``1 + epsilon`` times the average load, plus one job, because of where its caches are.

Pure: no I/O and no clock; the caller holds the index and says what ran where.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Characters a prefix block covers: about 64 tokens of English, so a 6 KB system prompt is
#: 24 blocks and a turn of a few sentences adds one or two.
BLOCK_CHARS = 256
#: The bound's slack: a server with the prefix may run up to 25 % more than the average...
DEFAULT_EPSILON = 0.25
#: ... and one job more: with fewer jobs than servers (a LAN's usual load) the capacity alone
#: is one job each, and two conversations that share a server could not both go back to it.
SLACK = 1

ServerId = str


def prefix_chain(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """The chained hashes of ``text``'s whole blocks (a partial last block is not hashed)."""
    if block_chars <= 0:
        raise ValueError(f"block_chars must be positive, got {block_chars}")
    chain: list[int] = []
    previous = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        digest = hashlib.blake2b(
            previous + text[start : start + block_chars].encode("utf-8", "surrogatepass"),
            digest_size=8,
        ).digest()
        chain.append(int.from_bytes(digest, "big"))
        previous = digest
    return tuple(chain)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest prefix one server holds: ``blocks`` whole blocks, in slot ``slot``."""

    blocks: int
    slot: int


class PrefixIndex:
    """Per server slot, the prefix chain of the last prompt sent there (see the module's
    docstring). ``capacity`` bounds the hashes kept in all: past it, the slots recorded
    longest ago are forgotten first."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self._capacity = capacity
        # (server, slot) -> chain, in the order recorded (oldest first: dicts keep order).
        self._slots: dict[tuple[ServerId, int], tuple[int, ...]] = {}
        # hash -> the slots whose chain holds it.
        self._holders: dict[int, set[tuple[ServerId, int]]] = {}
        self._size = 0

    def __len__(self) -> int:
        """The hashes kept, over every slot."""
        return self._size

    def record(
        self,
        server: ServerId,
        chain: tuple[int, ...],
        slots: int,
        busy: Iterable[int] = (),
    ) -> int:
        """``server`` (with ``slots`` slots, those in ``busy`` running other jobs) was sent the
        prompt whose chain is ``chain``; returns the slot that now holds it. The slot is the
        one llama-server picks among its idle slots: the one sharing the longest prefix with
        the prompt, else the one used longest ago (``get_available_slot`` in llama.cpp's
        ``server-context.cpp``; its 10 % similarity threshold is left out)."""
        taken = set(busy)
        idle = [slot for slot in range(slots) if slot not in taken] or list(range(slots))
        best, best_blocks = None, 0
        for slot in idle:
            kept = self._slots.get((server, slot))
            blocks = _common_blocks(kept, chain) if kept is not None else 0
            if blocks > best_blocks:
                best, best_blocks = slot, blocks
        if best is None:
            empty = [slot for slot in idle if (server, slot) not in self._slots]
            if empty:
                best = empty[0]
            else:  # the least recently recorded: the first in the index's order
                best = next(k[1] for k in self._slots if k[0] == server and k[1] in idle)
        self.put(server, best, chain)
        return best

    def put(self, server: ServerId, slot: int, chain: tuple[int, ...]) -> None:
        """Slot ``slot`` of ``server`` now holds the prompt whose chain is ``chain``."""
        key = (server, slot)
        self._drop(key)
        self._slots[key] = chain
        for digest in chain:
            self._holders.setdefault(digest, set()).add(key)
        self._size += len(chain)
        while self._size > self._capacity and self._slots:
            self._drop(next(iter(self._slots)))

    def forget(self, server: ServerId) -> None:
        """The server stopped or was lost: none of its slots holds anything now."""
        for key in [k for k in self._slots if k[0] == server]:
            self._drop(key)

    def match(self, chain: tuple[int, ...]) -> dict[ServerId, PrefixMatch]:
        """Each server holding at least one block of ``chain``, with its longest match."""
        found: dict[ServerId, PrefixMatch] = {}
        for depth, digest in enumerate(chain, start=1):
            holders = self._holders.get(digest)
            if not holders:
                break  # chained: no slot holds a longer prefix than one it does not hold
            for server, slot in holders:
                best = found.get(server)
                if (
                    best is None
                    or best.blocks < depth
                    or (best.blocks == depth and slot < best.slot)
                ):
                    found[server] = PrefixMatch(depth, slot)
        return found

    def held(self, server: ServerId) -> Iterable[int]:
        """The slots of ``server`` the index holds a prefix for."""
        return sorted(slot for s, slot in self._slots if s == server)

    def _drop(self, key: tuple[ServerId, int]) -> None:
        chain = self._slots.pop(key, None)
        if chain is None:
            return
        self._size -= len(chain)
        for digest in chain:
            holders = self._holders.get(digest)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._holders[digest]


def _common_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def load_bound(running: int, servers: int, epsilon: float = DEFAULT_EPSILON) -> int:
    """The most jobs one server may run after taking the next one: the bounded-load capacity
    ``ceil((1 + epsilon) * (running + 1) / servers)`` plus :data:`SLACK` jobs."""
    if servers <= 0:
        raise ValueError("load_bound needs at least one server")
    return math.ceil((1 + epsilon) * (running + 1) / servers) + SLACK


@dataclass(frozen=True, slots=True)
class PrefixRoute:
    """Where a job goes because of its prefix: ``server``, with ``blocks`` blocks matched in
    slot ``slot``."""

    server: ServerId
    blocks: int
    slot: int


def prefix_route(
    matches: Mapping[ServerId, PrefixMatch],
    running: Mapping[ServerId, int],
    *,
    epsilon: float = DEFAULT_EPSILON,
    min_blocks: int = 1,
) -> PrefixRoute | None:
    """The server among ``running``'s (the candidates, each with its running jobs) that holds
    the longest prefix of at least ``min_blocks`` blocks and is within the load bound; ties go
    to the less loaded server, then the smaller id. None: a miss, and the caller places the
    job as it would without a prefix."""
    if not running:
        return None
    bound = load_bound(sum(running.values()), len(running), epsilon)
    best: tuple[tuple[int, int, ServerId], PrefixRoute] | None = None
    for server, match in matches.items():
        load = running.get(server)
        if load is None or match.blocks < min_blocks or load + 1 > bound:
            continue
        rank = (-match.blocks, load, server)
        if best is None or rank < best[0]:
            best = (rank, PrefixRoute(server, match.blocks, match.slot))
    return None if best is None else best[1]
