"""Routing a conversation's next turn back to the server whose cache holds its prefix.

A chat client resends the whole history with every turn, and agent frameworks resend the same
long system prompt and tools with every call. llama-server keeps each slot's KV cache, so a
prompt that extends what a slot holds pays only for its new tokens, but only on the server
that holds it. :class:`PrefixRouter` keeps :class:`domain.prefix_index.PrefixIndex` (what the
controller sent where) and picks, among the warm servers that could take a job, the one with
the longest prefix of the job's prompt within the bounded-load rule
(:func:`domain.prefix_index.prefix_route`); a miss leaves the usual choice
(:attr:`domain.runtimes.WarmChoice.rank`). Every job records its route (``JOB_DISPATCHED``'s
``route``): ``{"prefix": "hit" | "miss", "matched_chars": n}``.

The prompt's canonical text is what the model's chat template will see first: the tools, then
each message's role and content, in order; a completion's prompt as it is. Embeddings are not
routed: nothing of them is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from application.commands import ChatPrompt, JobInput, TextPrompt
from domain.prefix_index import (
    BLOCK_CHARS,
    DEFAULT_EPSILON,
    PrefixIndex,
    PrefixRoute,
    prefix_chain,
    prefix_route,
)
from domain.runtimes import WarmChoice, server_name

#: Separators no text of a message carries: a message's role and content cannot run together.
_ROLE, _CONTENT = "\x1e", "\x1f"


def prefix_text(job: JobInput) -> str | None:
    """The text whose prefix a server's cache holds, or None for a job that is not routed."""
    if isinstance(job, ChatPrompt):
        parts = [orjson.dumps(job.tools, option=orjson.OPT_SORT_KEYS).decode()] if job.tools else []
        for message in job.messages:
            content = message.get("content")
            text = content if isinstance(content, str) else _json(content)
            rest = {k: v for k, v in message.items() if k not in ("role", "content")}
            parts.append(f"{_ROLE}{message.get('role', '')}{_CONTENT}{text}")
            if rest:  # tool calls, names: part of what the template renders
                parts.append(_json(rest))
        return "".join(parts)
    if isinstance(job, TextPrompt):
        return job.text if isinstance(job.text, str) else " ".join(map(str, job.text))
    return None


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


class PrefixRouter:
    """The controller's memory of what each warm server's cache holds, and the choice it makes
    from it. One per controller. Placements take turns (``JobSetup``, in the scheduler's
    decision thread), so the index needs no lock."""

    def __init__(
        self,
        *,
        block_chars: int = BLOCK_CHARS,
        epsilon: float = DEFAULT_EPSILON,
        capacity: int = 1_000_000,
        enabled: bool = True,
    ) -> None:
        #: False (``PREFIX_ROUTING=off``): no prompt is routed by its prefix, none is
        #: remembered, and no route is recorded: every job takes the usual choice.
        self.enabled = enabled
        self.block_chars = block_chars
        self.epsilon = epsilon
        self.index = PrefixIndex(capacity)

    def chain(self, job: JobInput) -> tuple[int, ...]:
        """The job's prefix chain; empty for a job that is not routed or is shorter than a
        block, and for every job when routing is off."""
        if not self.enabled:
            return ()
        text = prefix_text(job)
        return prefix_chain(text, self.block_chars) if text else ()

    def choose(
        self, chain: tuple[int, ...], choices: Sequence[WarmChoice]
    ) -> tuple[WarmChoice, PrefixRoute | None] | None:
        """The warm server for a job, and its prefix route when the prefix chose it; None when
        there is no warm server."""
        if not choices:
            return None
        if chain:
            by_server = {choice.server: choice for choice in choices}
            running = {server: choice.running for server, choice in by_server.items()}
            route = prefix_route(self.index.match(chain), running, epsilon=self.epsilon)
            if route is not None:
                return by_server[route.server], route
        return choices[0], None

    def next_to_go(
        self, waiting: Sequence[tuple[tuple[int, ...], bool]], servers: Sequence[WarmChoice]
    ) -> tuple[int | None, list[int]]:
        """Which waiting job takes a free slot now, and which let it go by.

        ``waiting`` is the queue's head and the jobs that may go before it, in order, each as
        (its prompt's chain, whether it may still pass: :func:`application.admission.may_pass`);
        ``servers`` are the model's warm servers, busy ones included. The first job that
        :meth:`choose` would send to the server holding its longest prefix goes. A job whose
        conversation is on a busy server (it holds an earlier turn, longer than any free
        server's match: :attr:`PrefixMatch.extends`) waits for it (it *passes*) while it may,
        and while fewer jobs wait for that server than it has slots; any other job (a new
        conversation, even one whose system prompt a busy server holds; a server gone) takes
        the free slot as usual: a prefix shared with other prompts is soon on every server
        that serves them, and is not worth a wait. Returns (its position, or None when every
        job waits for its own server; the positions that passed). With no free slot the head
        goes: a cold plan may start a server for it."""
        free = {choice.server: choice.running for choice in servers if choice.free_slots > 0}
        if not free or not self.enabled:
            return 0, []
        slots = {choice.server: choice.plan.parallel for choice in servers}
        waiting_for: dict[str, int] = {}
        passed: list[int] = []
        for position, (chain, may_pass) in enumerate(waiting):
            matches = self.index.match(chain) if chain else {}
            if not matches:
                return position, passed
            longest = max(match.blocks for match in matches.values())
            route = prefix_route(matches, free, epsilon=self.epsilon)
            if route is not None and route.blocks == longest:
                return position, passed
            at_free = max((m.blocks for s, m in matches.items() if s in free), default=0)
            turn = max(match.extends for match in matches.values())
            homes = sorted(s for s, m in matches.items() if m.extends == turn and s in slots)
            if (
                turn <= at_free
                or not homes
                or not may_pass
                or waiting_for.get(homes[0], 0) >= slots[homes[0]]
            ):
                return position, passed
            waiting_for[homes[0]] = waiting_for.get(homes[0], 0) + 1
            passed.append(position)
        return None, passed

    def sent(self, server: str, chain: tuple[int, ...], cache_blocks: int) -> None:
        """A job whose prompt has ``chain`` was placed on ``server``, which holds at most
        ``cache_blocks`` blocks (:func:`domain.prefix_index.server_cache_blocks`)."""
        self.index.record(server, chain, cache_blocks)

    def forget(self, server: str) -> None:
        """``server`` stopped or was lost: its cache is gone."""
        self.index.forget(server)

    def forget_node(self, node_id: str) -> None:
        """``node_id`` was lost (its agent stopped, or it stayed away past the reconnect
        grace): the servers it ran are gone with their caches."""
        for server in self.index.servers():
            if server.startswith(server_name(node_id, "")):
                self.index.forget(server)

    def route_of(self, job: JobInput, route: PrefixRoute | None) -> dict[str, Any] | None:
        """What JOB_DISPATCHED records: hit or miss and the characters matched; None for a job
        that is not routed (embeddings, or any job when routing is off)."""
        if not self.enabled or prefix_text(job) is None:
            return None
        if route is None:
            return {"prefix": "miss", "matched_chars": 0}
        return {"prefix": "hit", "matched_chars": route.blocks * self.block_chars}
