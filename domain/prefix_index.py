"""What each warm server's cache holds, approximately, so that a conversation's next turn goes
back to the server that already holds its prefix.

llama-server keeps each slot's KV cache after a request ends (``cache_prompt``), and a prompt
that extends what it holds only pays for its new tokens. When a slot is given to another
prompt, llama-server first saves what the slot held in its host-memory *prompt cache*
(``--cache-ram``, 8 GiB by default; llama.cpp PR 16391), and loads from there the saved prompt
that best matches the new one. So a server holds many conversations, not one per slot: its
slots' and its prompt cache's, oldest dropped first once the cache is full, and a saved prompt
that a longer one contains is dropped for it. The controller cannot see those caches; it
remembers what it sent instead:

* A prompt's *prefix chain* (:func:`prefix_chain`) hashes its canonical text in blocks of
  :data:`BLOCK_CHARS` characters, each hash covering every block before it (``h[i]`` stands for
  the first ``i + 1`` blocks). Two prompts share their first ``k`` hashes exactly when they
  share their first ``k`` blocks (up to a 64-bit collision), so a match needs no text kept.
* :class:`PrefixIndex` keeps, per server, the chains of the prompts dispatched there, in the
  order last sent: a prompt that extends one the server holds replaces it (the conversation
  grew), and past the server's capacity (:func:`server_cache_blocks`: its slots and its prompt
  cache, in blocks) the prompts sent longest ago age out. A server that stops or is lost is
  forgotten whole.
* :func:`prefix_route` picks the server holding the longest prefix unless it is loaded beyond
  the bound of consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
  2018), plus one job of slack: a server may take a job only while its running jobs stay
  within ``ceil((1 + epsilon) * (running + 1) / servers) + 1``, so no server takes more than
  ``1 + epsilon`` times the average load, plus one job, because of where its caches are.

The agent does not name a slot (``id_slot``): llama-server already picks the idle slot with the
longest common prefix (or loads the prompt from its cache), and a named slot that is busy would
make the request wait. Pure: no I/O and no clock; the caller holds the index and says what ran
where.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from common.contract import PROMPT_CACHE_BYTES
from domain.set_index import discard

#: Characters a prefix block covers: about 64 tokens of English, so a 6 KB system prompt is
#: 24 blocks and a turn of a few sentences adds one or two.
BLOCK_CHARS = 256
#: The bound's slack: a server with the prefix may run up to 25 % more than the average...
DEFAULT_EPSILON = 0.25
#: ... and one job more: with fewer jobs than servers (a LAN's usual load) the capacity alone
#: is one job each, and two conversations that share a server could not both go back to it.
SLACK = 1

# A server's prompt cache is counted up to common.contract.PROMPT_CACHE_BYTES: an agent on a
# node with little memory gives it less, and the index then over-counts what it holds.
#: The KV bytes per token assumed for a model that does not say (a 7B model's in f16).
ASSUMED_KV_BYTES_PER_TOKEN = 128 << 10
#: Characters per token, roughly (English text), to turn a cache's tokens into blocks.
CHARS_PER_TOKEN = 4

ServerId = str


def server_cache_blocks(
    kv_bytes_per_token: int,
    slot_tokens: int,
    slots: int,
    block_chars: int = BLOCK_CHARS,
) -> int:
    """The prefix blocks a server holds at most: its ``slots`` slots of ``slot_tokens`` tokens
    each, and the tokens its prompt cache has room for at ``kv_bytes_per_token``."""
    per_token = kv_bytes_per_token if kv_bytes_per_token > 0 else ASSUMED_KV_BYTES_PER_TOKEN
    tokens = slots * slot_tokens + PROMPT_CACHE_BYTES // per_token
    return max(1, tokens * CHARS_PER_TOKEN // block_chars)


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
    """The longest prefix one server holds: ``blocks`` whole blocks; ``extends``, the longest
    prompt it holds that is all a prefix of the new one (an earlier turn of the conversation),
    in blocks (0: none, only a beginning shared with other prompts, such as a system prompt)."""

    blocks: int
    extends: int = 0


_Key = tuple[ServerId, int]


class PrefixIndex:
    """Per server, the prefix chains of the prompts it holds (see the module's docstring).
    ``capacity`` bounds the hashes kept over every server: past it, the prompts sent longest
    ago are forgotten first."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self._capacity = capacity
        # (server, n) -> chain, the whole index in the order sent (oldest first).
        self._prompts: dict[_Key, tuple[int, ...]] = {}
        # server -> its keys, in the order sent; and the blocks it holds.
        self._servers: dict[ServerId, dict[_Key, None]] = {}
        self._blocks: dict[ServerId, int] = {}
        # hash -> the prompts whose chain holds it; (server, hash) -> those whose chain ends
        # with it (a prompt ending with one of a new chain's hashes is a prefix of it).
        self._holders: dict[int, set[_Key]] = {}
        self._ends: dict[tuple[ServerId, int], set[_Key]] = {}
        self._size = 0
        self._sent = 0

    def __len__(self) -> int:
        """The hashes kept, over every server."""
        return self._size

    def record(self, server: ServerId, chain: tuple[int, ...], server_blocks: int) -> None:
        """``server``, which holds at most ``server_blocks`` blocks (:func:`server_cache_blocks`),
        was sent the prompt whose chain is ``chain``: it holds it now. A prompt it held that
        this one extends is gone (llama-server keeps the longer one); past ``server_blocks``
        the prompts it was sent longest ago are."""
        if not chain:
            return
        for digest in chain:
            for key in list(self._ends.get((server, digest), ())):
                self._drop(key)
        key = (server, self._sent)
        self._sent += 1
        self._prompts[key] = chain
        self._servers.setdefault(server, {})[key] = None
        self._blocks[server] = self._blocks.get(server, 0) + len(chain)
        self._ends.setdefault((server, chain[-1]), set()).add(key)
        for digest in chain:
            self._holders.setdefault(digest, set()).add(key)
        self._size += len(chain)
        held = self._servers[server]
        while self._blocks.get(server, 0) > server_blocks and len(held) > 1:
            self._drop(next(iter(held)))
        while self._size > self._capacity and self._prompts:
            self._drop(next(iter(self._prompts)))

    def forget(self, server: ServerId) -> None:
        """The server stopped or was lost: it holds nothing now."""
        for key in list(self._servers.get(server, ())):
            self._drop(key)

    def servers(self) -> list[ServerId]:
        """The servers that hold a prompt, as far as the index knows."""
        return list(self._servers)

    def match(self, chain: tuple[int, ...]) -> dict[ServerId, PrefixMatch]:
        """Each server holding at least one block of ``chain``, with its longest match and the
        longest of its prompts that ``chain`` extends."""
        found: dict[ServerId, PrefixMatch] = {}
        for depth, digest in enumerate(chain, start=1):
            holders = self._holders.get(digest)
            if not holders:
                break  # chained: no prompt holds a longer prefix than one it does not hold
            for server, _ in holders:
                extends = depth if (server, digest) in self._ends else 0
                if not extends and server in found:
                    extends = found[server].extends
                found[server] = PrefixMatch(depth, extends)
        return found

    def prompts(self, server: ServerId) -> int:
        """How many prompts ``server`` holds, as far as the index knows."""
        return len(self._servers.get(server, ()))

    def _drop(self, key: _Key) -> None:
        chain = self._prompts.pop(key, None)
        if chain is None:
            return
        server = key[0]
        held = self._servers[server]
        del held[key]
        if not held:
            del self._servers[server]
        self._blocks[server] -= len(chain)
        if not self._blocks[server]:
            del self._blocks[server]
        self._size -= len(chain)
        discard(self._ends, (server, chain[-1]), key)
        for digest in chain:
            discard(self._holders, digest, key)


def load_bound(running: int, servers: int, epsilon: float = DEFAULT_EPSILON) -> int:
    """The most jobs one server may run after taking the next one: the bounded-load capacity
    ``ceil((1 + epsilon) * (running + 1) / servers)`` plus :data:`SLACK` jobs."""
    if servers <= 0:
        raise ValueError("load_bound needs at least one server")
    return math.ceil((1 + epsilon) * (running + 1) / servers) + SLACK


@dataclass(frozen=True, slots=True)
class PrefixRoute:
    """Where a job goes because of its prefix: ``server``, with ``blocks`` blocks matched."""

    server: ServerId
    blocks: int


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
            best = (rank, PrefixRoute(server, match.blocks))
    return None if best is None else best[1]
