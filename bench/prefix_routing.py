"""Cache-aware routing on and off, side by side: where a conversation's later turns land.

    python -m bench.prefix_routing              # 4 nodes x 2 slots, 12 conversations x 4 turns
    python -m bench.prefix_routing --conversations 24 --turns 6

The scenario of issue 24: ``--nodes`` synthetic agents (``bench/synthetic_agents.py``: the real
control protocol, no llama.cpp) with ``--slots`` slots each; ``--conversations`` chats run at
once through the real HTTP API (``/v1/chat/completions``), each turn resending a shared 6 KB
system prompt (:data:`SYSTEM`) and the conversation's history (user turns of a few hundred
characters, the answers as they came). The controller runs in this process on Postgres and
Redis, once with ``PREFIX_ROUTING`` on and once off (``Settings.prefix_routing``).

Reported per run, from the admin jobs API (each job's plan and ``route``): the later turns that
landed on the node of their conversation's first turn (n of conversations x (turns - 1)); the
prefix hit ratio (jobs whose ``JOB_DISPATCHED`` route is a hit, of all jobs; routing off records
no route); queue wait (0 for a job that did not wait) and client latency per turn (median,
p90). Synthetic agents keep no KV cache, so the latency here shows the routing's own cost, not
the prefill it saves on a real server. With fewer slots than conversations (the defaults) a later
turn often finds its server busy: with routing it waits for that server, within the admission
queue's bound (``application/admission.py``), so its wait and the run's wall time may grow a
little here, where no prefill is saved; with routing off it takes the freest server.

:func:`converse` and :func:`landed` are the scenario and its reading; the integration test
``tests/integration/test_prefix_routing_flow.py`` runs them against FakeAgents.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import psycopg

from bench import stats
from bench.synthetic_agents import Agent, Options, Totals
from common.contract import CONTROLLER_TLS_NAME
from domain.enrollment_token import mint_token
from infrastructure.settings import Settings
from interfaces.controller_main import RunningController, controller

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "m"
MODEL_SHA = "9c" * 32

#: The shared system prompt every turn of every conversation resends: about 6 KB.
SYSTEM = (
    "You are the assistant of the operators of a small LAN cluster that serves language "
    "models. Answer briefly, cite the log lines you rely on, and never guess a node's state. "
) * 36


def ask(conversation: int, turn: int) -> str:
    """A user's turn: a few hundred characters, its own to the conversation."""
    return f"Conversation {conversation}, question {turn}: " + (
        f"what did node {conversation % 7} log about slot {turn} after the restart? " * 4
    )


@dataclass(frozen=True)
class Turn:
    """One request of the scenario: its conversation, turn (1-based), job and client time."""

    conversation: int
    turn: int
    job_id: str
    latency_s: float


@dataclass(frozen=True)
class Landed:
    """Where one turn's job ran, as the admin jobs API tells it."""

    turn: Turn
    node: str
    route: Mapping[str, Any] | None
    queue_wait_ms: float | None


@dataclass(frozen=True)
class Outcome:
    """A run of the scenario, read back."""

    turns: list[Landed]

    def later_turns_home(self) -> tuple[int, int]:
        """(later turns on their conversation's first-turn node, later turns)."""
        home = {t.turn.conversation: t.node for t in self.turns if t.turn.turn == 1}
        later = [t for t in self.turns if t.turn.turn > 1]
        return sum(1 for t in later if t.node == home[t.turn.conversation]), len(later)

    def hits(self) -> int:
        return sum(1 for t in self.turns if (t.route or {}).get("prefix") == "hit")


def job_id_of(completion_id: str) -> str:
    """The job id inside an OpenAI completion id."""
    return str(uuid.UUID(completion_id.removeprefix("chatcmpl-")))


async def converse(
    client: httpx.AsyncClient,
    ai_key: str,
    *,
    conversations: int = 12,
    turns: int = 4,
    model: str = MODEL,
    max_tokens: int = 64,
) -> list[Turn]:
    """``conversations`` chats at once, each ``turns`` turns one after the other: every turn
    sends the system prompt and the whole history; the answer joins the history."""
    headers = {"Authorization": f"Bearer {ai_key}"}

    async def chat(conversation: int) -> list[Turn]:
        history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        done = []
        for turn in range(1, turns + 1):
            history.append({"role": "user", "content": ask(conversation, turn)})
            body = {"model": model, "messages": history, "max_tokens": max_tokens}
            started = time.perf_counter()
            response = await client.post("/v1/chat/completions", headers=headers, json=body)
            latency = time.perf_counter() - started
            response.raise_for_status()
            answer = response.json()
            history.append(
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
            )
            done.append(Turn(conversation, turn, job_id_of(answer["id"]), latency))
        return done

    results = await asyncio.gather(*(chat(c) for c in range(conversations)))
    return [turn for result in results for turn in result]


async def landed(client: httpx.AsyncClient, admin_key: str, turns: list[Turn]) -> Outcome:
    """Each turn's node (its plan's primary), route and queue wait from the admin jobs API."""
    headers = {"Authorization": f"Bearer {admin_key}"}

    async def one(turn: Turn) -> Landed:
        deadline = time.monotonic() + 10
        while True:  # the read model follows the store: the job's end may not be there yet
            response = await client.get(f"/api/admin/jobs/{turn.job_id}", headers=headers)
            if response.status_code == 200 and response.json()["state"] == "COMPLETED":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {turn.job_id} never read back: {response.text}")
            await asyncio.sleep(0.05)
        job = response.json()
        return Landed(
            turn,
            str(job["plan"]["primary"]["node_id"]),
            job["route"],
            job["timings"]["queue_wait_ms"],
        )

    return Outcome(list(await asyncio.gather(*(one(t) for t in turns))))


@dataclass(frozen=True)
class Figures:
    routing: bool
    later_home: int
    later: int
    hits: int
    jobs: int
    queue_wait_ms: stats.Summary | None
    latency_ms: stats.Summary | None
    wall_s: float


def figures(routing: bool, outcome: Outcome, wall_s: float) -> Figures:
    home, later = outcome.later_turns_home()
    return Figures(
        routing=routing,
        later_home=home,
        later=later,
        hits=outcome.hits(),
        jobs=len(outcome.turns),
        queue_wait_ms=stats.summarize([t.queue_wait_ms or 0.0 for t in outcome.turns]),
        latency_ms=stats.summarize([t.turn.latency_s * 1000 for t in outcome.turns]),
        wall_s=wall_s,
    )


async def _agents(
    running: RunningController, secret: str, opts: Options
) -> list[asyncio.Task[None]]:
    """``opts.count`` synthetic agents enrolled and connected to ``running``."""
    tls = running.services.tls
    target = f"127.0.0.1:{running.grpc_port}"
    if tls is None:
        channel = grpc.aio.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca_pem)
        options = [("grpc.ssl_target_name_override", CONTROLLER_TLS_NAME)]
        channel = grpc.aio.secure_channel(target, credentials, options=options)
    token = mint_token(secret.encode(), "bench", time.time() + 600, False, None)
    connected = asyncio.Event()
    totals = Totals()
    tasks = [
        asyncio.create_task(
            Agent(channel, f"{opts.name_prefix}{i}", opts, totals).run(token, connected)
        )
        for i in range(opts.count)
    ]
    await asyncio.wait_for(connected.wait(), 30)
    return tasks


async def run_once(routing: bool, args: argparse.Namespace, var_dir: Path) -> Figures:
    """One controller (routing on or off), its agents, the scenario, its figures."""
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    ai_key, admin_key, secret = (secrets.token_urlsafe(16) for _ in range(3))
    settings = Settings(
        database_url=f"{args.database_url}?schema={schema}",
        redis_url=args.redis_url,
        redis_key_prefix=f"dacp-bench:{schema}:",
        ai_api_key=ai_key,
        admin_api_key=admin_key,
        node_enrollment_secret=secret,
        port=0,
        grpc_port=0,
        model_store_port=None,
        heartbeat_interval=0.5,
        var_dir=var_dir / schema,
        prefix_routing=routing,
    )
    opts = Options(
        count=args.nodes,
        slots=args.slots,
        memory=4 << 30,
        holds=MODEL_SHA,
        tokens=args.tokens,
        tokens_per_message=args.tokens_per_message,
        message_interval=args.message_interval,
        first_token_delay=args.first_token_delay,
        name_prefix="prefix-bench-",
    )
    try:
        async with controller(settings) as running:
            agents = await _agents(running, secret, opts)
            base = f"http://127.0.0.1:{running.http_port}"
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                await ready(client, admin_key, args.nodes)
                started = time.perf_counter()
                turns = await converse(
                    client,
                    ai_key,
                    conversations=args.conversations,
                    turns=args.turns,
                    max_tokens=args.tokens,
                )
                wall = time.perf_counter() - started
                outcome = await landed(client, admin_key, turns)
            for task in agents:
                task.cancel()
            return figures(routing, outcome, wall)
    finally:
        with psycopg.connect(args.database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')  # type: ignore[arg-type]


async def ready(client: httpx.AsyncClient, admin_key: str, nodes: int) -> None:
    """The model registered and every node READY holding it."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    model = {"name": MODEL, "sha256": MODEL_SHA, "file_name": "m.gguf", "context_size": 8192}
    (await client.post("/api/admin/models", headers=headers, json=model)).raise_for_status()
    deadline = time.monotonic() + 60
    while True:
        rows = (await client.get("/api/admin/nodes", headers=headers)).json()["data"]
        if sum(1 for r in rows if r["state"] == "READY" and r["local_models"]) == nodes:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"nodes not ready: {[(r['name'], r['state']) for r in rows]}")
        await asyncio.sleep(0.2)


def table(results: list[Figures]) -> str:
    def ms(summary: stats.Summary | None) -> str:
        if summary is None:
            return stats.MISSING
        return f"{stats.fmt(summary.median)} / {stats.fmt(summary.p90)}"

    rows = [
        [
            "on" if f.routing else "off",
            f"{f.later_home}/{f.later}",
            f"{f.hits}/{f.jobs}" if f.routing else "- (not recorded)",
            ms(f.queue_wait_ms),
            ms(f.latency_ms),
            stats.fmt(f.wall_s, 2),
        ]
        for f in results
    ]
    headers = [
        "routing",
        "later turns home",
        "prefix hits",
        "queue wait ms p50/p90",
        "latency ms p50/p90",
        "wall s",
    ]
    return stats.format_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_routing")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--tokens-per-message", type=int, default=8)
    parser.add_argument("--message-interval", type=float, default=0.01, help="seconds")
    parser.add_argument("--first-token-delay", type=float, default=0.05, help="seconds")
    parser.add_argument(
        "--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)
    )
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS_URL))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> list[Figures]:
    with tempfile.TemporaryDirectory(prefix="dacp-prefix-bench-") as var:
        return [await run_once(routing, args, Path(var)) for routing in (True, False)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results = asyncio.run(_main(args))
    print(
        f"{args.nodes} nodes x {args.slots} slots, {args.conversations} conversations x "
        f"{args.turns} turns at once, a {len(SYSTEM)}-character system prompt shared"
    )
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps([stats_dict(f) for f in results], indent=2), encoding="utf-8"
        )
    return 0


def stats_dict(f: Figures) -> dict[str, Any]:
    return {
        "routing": f.routing,
        "later_turns_home": f.later_home,
        "later_turns": f.later,
        "prefix_hits": f.hits if f.routing else None,
        "jobs": f.jobs,
        "queue_wait_ms": f.queue_wait_ms.to_dict() if f.queue_wait_ms else None,
        "latency_ms": f.latency_ms.to_dict() if f.latency_ms else None,
        "wall_s": f.wall_s,
    }


if __name__ == "__main__":
    sys.exit(main())
