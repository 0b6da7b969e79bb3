"""Conversations on real llama.cpp, cache-aware routing on and off, interleaved in one run.

    python -m bench.conversations                        # 4 conversations x 4 turns, 2 slots
    python -m bench.conversations --conversations 6 --turns 5

Two local clusters of the cached test model run side by side (``ops/local_cluster.py``), each
with two agents that hold the model and may each run it alone, so each has two warm servers of
one model: one with ``PREFIX_ROUTING`` on, one with it off. Each agent's llama.cpp computes
with ``--threads`` threads (1: the two servers of a mode compute at once on two cores without
oversubscribing them; llama.cpp's threads spin while they wait for each other, and four of them
on two cores ran prefill about 8x slower). Before the conversations each
cluster is warmed until both its nodes serve the model (a burst of requests beyond one server's
slots starts a replica on the other node, issue 24 item 2).

Every conversation resends a shared system prompt of about ``--system-tokens`` tokens and its
history (its user turns of about ``--user-tokens`` tokens each, the answers as they came, up to
``--max-tokens`` each: a chat's shape, short questions and longer answers). Turn
``t`` of all conversations is sent at once to one cluster, then to the other; which cluster goes
first alternates per turn, so drifts in machine load hit both alike and the two clusters never
compute at the same time. Then ``--singles`` single-turn prompts that share nothing with each
other (nor with the conversations) go the same way, a group of ``--conversations`` at a time:
routing must cost them nothing.

Per request, from the client: time to first token (the first non-empty content delta), and from
the stream's usage chunk the prompt tokens and of them those llama-server took from its cache
(``prompt_tokens_details.cached_tokens``). Per mode: TTFT p50/p95 of first turns, later turns
and singles; prompt tokens processed against cached; completion tokens per second of the
conversation phases' wall time. A JSON file goes under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openai import OpenAI, OpenAIError
from openai.types.chat import ChatCompletionMessageParam

from bench import stats
from ops.local_cluster import MODEL_NAME, AgentSpec, ClusterConfig, LocalCluster

MODES = ("on", "off")
#: Each agent offers this much memory: enough for the test model alone, with its slots.
SOLO_MEMORY_LIMIT = 4 * 1024 * 1024 * 1024
REQUEST_TIMEOUT = 300.0
#: Words the prompts are made of: common English, about one token each for the test model.
WORDS = (
    "river stone garden window paper light music table forest cloud market engine bridge "
    "winter letter silver morning harbor valley candle orange station button planet "
    "kitchen mirror pocket ladder blanket rocket island castle pencil bottle meadow "
    "signal thunder meadow copper lantern village shadow feather basket compass"
).split()


@dataclass
class Turn:
    """One request and what the client measured of it."""

    mode: str
    kind: str  # "first", "later" or "single"
    conversation: int
    turn: int
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""
    error: str | None = None


@dataclass
class Mode:
    key: str
    cluster: LocalCluster
    client: OpenAI
    #: The conversations' histories (OpenAI messages), one list per conversation.
    histories: list[list[ChatCompletionMessageParam]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    #: Wall time of the conversation phases (all turns), for the token rate.
    conversation_wall_s: float = 0.0


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def system_prompt(rng: random.Random, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens, new to the servers (a random preamble)."""
    return f"You are a helpful assistant. Session {rng.getrandbits(64):x}. " + words(rng, tokens)


def user_turn(rng: random.Random, conversation: int, turn: int, tokens: int) -> str:
    return (
        f"Conversation {conversation}, question {turn}: {words(rng, tokens)}. "
        "Answer in one short sentence."
    )


def ask(
    client: OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, turn: Turn
) -> Turn:
    """Stream one chat completion and time it."""
    start = time.perf_counter()
    parts: list[str] = []
    try:
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            for chunk in stream:
                if chunk.usage is not None:
                    turn.prompt_tokens = chunk.usage.prompt_tokens
                    turn.completion_tokens = chunk.usage.completion_tokens
                    details = chunk.usage.prompt_tokens_details
                    turn.cached_tokens = details.cached_tokens if details else None
                for choice in chunk.choices:
                    if choice.delta.content:
                        if turn.ttft_s is None:
                            turn.ttft_s = time.perf_counter() - start
                        parts.append(choice.delta.content)
    except OpenAIError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    turn.total_s = time.perf_counter() - start
    turn.text = "".join(parts)
    if turn.error is None and turn.ttft_s is None:
        turn.error = "the stream carried no content"
    return turn


def at_once(
    pool: ThreadPoolExecutor,
    mode: Mode,
    requests: Sequence[tuple[list[ChatCompletionMessageParam], Turn]],
    max_tokens: int,
) -> tuple[list[Turn], float]:
    """Sends ``requests`` at once to ``mode``'s cluster; their turns and the wall time."""
    start = time.perf_counter()
    futures = [pool.submit(ask, mode.client, msgs, max_tokens, t) for msgs, t in requests]
    done = [f.result() for f in futures]
    mode.turns.extend(done)
    return done, time.perf_counter() - start


def start_mode(stack: contextlib.ExitStack, key: str, args: argparse.Namespace) -> Mode:
    routing = "true" if key == "on" else "false"
    agents = tuple(
        AgentSpec(
            f"conv-{key}-{name}",
            0,
            memory_limit=SOLO_MEMORY_LIMIT,
            holds_model=True,
            extra_args=("--slots", str(args.slots), "--threads", str(args.threads)),
        )
        for name in ("a", "b")
    )
    config = ClusterConfig(
        var_dir=Path(args.var_dir) / f"routing-{key}",
        port=0,
        grpc_port=0,
        agents=agents,
        extra_env={"PREFIX_ROUTING": routing},
        quiet=True,
        context_size=args.context,
    )
    say(f"[{key}] starting a local cluster, PREFIX_ROUTING={routing} ...")
    cluster = stack.enter_context(LocalCluster(config))
    client = OpenAI(
        base_url=f"{cluster.url}/v1",
        api_key=cluster.ai_api_key,
        timeout=REQUEST_TIMEOUT,
        max_retries=0,
    )
    say(f"[{key}] ready at {cluster.url}")
    return Mode(key, cluster, client)


def warm(pool: ThreadPoolExecutor, mode: Mode, args: argparse.Namespace) -> int:
    """Bursts of requests beyond one server's slots until both nodes serve the model; the
    number of nodes that served a warm-up request."""
    nodes: set[str] = set()
    for attempt in range(args.warm_rounds):
        burst: list[tuple[list[ChatCompletionMessageParam], Turn]] = [
            (
                [{"role": "user", "content": f"Warm-up {attempt}.{i}: count from one to forty."}],
                Turn(mode.key, "warm", i, attempt),
            )
            for i in range(2 * args.slots + 1)
        ]
        turns, _ = at_once(pool, mode, burst, 48)
        mode.turns[-len(turns) :] = []  # not counted
        failed = [t.error for t in turns if t.error]
        if failed:
            raise RuntimeError(f"[{mode.key}] a warm-up request failed: {failed[0]}")
        nodes |= serving_nodes(mode.cluster)
        if len(nodes) >= 2:
            break
    return len(nodes)


def serving_nodes(cluster: LocalCluster) -> set[str]:
    """The nodes that ran a job as its primary, from the admin jobs API."""
    import httpx

    answer = httpx.get(
        f"{cluster.url}/api/admin/jobs",
        params={"limit": 200},
        headers={"Authorization": f"Bearer {cluster.admin_api_key}"},
        timeout=10,
    )
    answer.raise_for_status()
    found: set[str] = set()
    for job in answer.json().get("data", []):
        primary = (job.get("plan") or {}).get("primary") or {}
        if primary.get("node_id"):
            found.add(str(primary["node_id"]))
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    system = system_prompt(rng, args.system_tokens)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=4 * args.conversations))
        modes = {key: start_mode(stack, key, args) for key in MODES}
        for mode in modes.values():
            served = warm(pool, mode, args)
            say(f"[{mode.key}] warm: {served} node(s) serve the model")
            mode.histories = [
                [{"role": "system", "content": system}] for _ in range(args.conversations)
            ]
        questions = [
            [user_turn(rng, c, t, args.user_tokens) for t in range(1, args.turns + 1)]
            for c in range(args.conversations)
        ]
        for t in range(1, args.turns + 1):
            order = MODES if t % 2 else tuple(reversed(MODES))
            for key in order:
                mode = modes[key]
                kind = "first" if t == 1 else "later"
                requests: list[tuple[list[ChatCompletionMessageParam], Turn]] = []
                for c, history in enumerate(mode.histories):
                    history.append({"role": "user", "content": questions[c][t - 1]})
                    requests.append((list(history), Turn(key, kind, c, t)))
                turns, wall = at_once(pool, mode, requests, args.max_tokens)
                mode.conversation_wall_s += wall
                for c, turn in enumerate(turns):
                    mode.histories[c].append({"role": "assistant", "content": turn.text})
                say(f"[{key}] turn {t}: {line(turns)}")
        groups = (args.singles + args.conversations - 1) // args.conversations
        for g in range(groups):
            order = MODES if g % 2 else tuple(reversed(MODES))
            prompts = [
                f"Unrelated question {g}.{i}: {words(rng, args.user_tokens)}. Say one word."
                for i in range(args.conversations)
            ]
            for key in order:
                requests = [(_user(p), Turn(key, "single", i, g)) for i, p in enumerate(prompts)]
                turns, _ = at_once(pool, modes[key], requests, args.max_tokens)
                say(f"[{key}] singles {g + 1}/{groups}: {line(turns)}")
        return summarize(modes, args)


def _user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def line(turns: Sequence[Turn]) -> str:
    ttfts = [t.ttft_s * 1000 for t in turns if t.ttft_s is not None]
    errors = [t.error for t in turns if t.error]
    cached = sum(t.cached_tokens or 0 for t in turns)
    prompt = sum(t.prompt_tokens or 0 for t in turns)
    said = f"TTFT median {stats.fmt(stats.percentile(ttfts, 50) if ttfts else None, 0)} ms"
    said += f", {cached}/{prompt} prompt tokens cached"
    return said + (f", {len(errors)} failed: {errors[0]}" if errors else "")


def _ms(turns: Sequence[Turn], q: float) -> float | None:
    values = [t.ttft_s * 1000 for t in turns if t.ttft_s is not None]
    return round(stats.percentile(values, q), 1) if values else None


def summarize(modes: dict[str, Mode], args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": vars(args),
        "modes": {},
    }
    for key, mode in modes.items():
        by_kind = {k: [t for t in mode.turns if t.kind == k] for k in ("first", "later", "single")}
        conversation = by_kind["first"] + by_kind["later"]
        prompt = sum(t.prompt_tokens or 0 for t in conversation)
        cached = sum(t.cached_tokens or 0 for t in conversation)
        completion = sum(t.completion_tokens or 0 for t in conversation)
        result["modes"][key] = {
            **{f"{k}_ttft_p50_ms": _ms(v, 50) for k, v in by_kind.items()},
            **{f"{k}_ttft_p95_ms": _ms(v, 95) for k, v in by_kind.items()},
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "processed_tokens": prompt - cached,
            "completion_tokens": completion,
            "tokens_per_s": round(completion / mode.conversation_wall_s, 2)
            if mode.conversation_wall_s
            else None,
            "failed": sum(1 for t in mode.turns if t.error),
            "turns": [asdict(t) | {"text": None} for t in mode.turns],
        }
    on, off = result["modes"]["on"], result["modes"]["off"]
    result["later_ttft_p50_off_over_on"] = stats.ratio(
        off["later_ttft_p50_ms"], on["later_ttft_p50_ms"]
    )
    result["single_ttft_p50_on_over_off"] = stats.ratio(
        on["single_ttft_p50_ms"], off["single_ttft_p50_ms"]
    )
    return result


def _pair(mode: dict[str, Any], kind: str) -> str:
    p50, p95 = mode[f"{kind}_ttft_p50_ms"], mode[f"{kind}_ttft_p95_ms"]
    return f"{stats.fmt(p50, 0)} / {stats.fmt(p95, 0)}"


def report(result: dict[str, Any]) -> str:
    rows = []
    for key in MODES:
        m = result["modes"][key]
        rows.append(
            [
                f"routing {key}",
                *(_pair(m, kind) for kind in ("first", "later", "single")),
                f"{m['processed_tokens']:,} / {m['cached_tokens']:,}",
                stats.fmt(m["tokens_per_s"], 1),
                str(m["failed"]),
            ]
        )
    table = stats.format_table(
        [
            "mode",
            "first turn TTFT p50/p95 ms",
            "later turns p50/p95 ms",
            "singles p50/p95 ms",
            "prompt tokens processed / cached",
            "tokens/s",
            "failed",
        ],
        rows,
    )
    return (
        f"{table}\n\nlater turns' TTFT p50, off / on: "
        f"{stats.fmt_ratio(result['later_ttft_p50_off_over_on'])}; singles' TTFT p50, on / off: "
        f"{stats.fmt_ratio(result['single_ttft_p50_on_over_off'])}"
    )


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.conversations", description=__doc__)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=60, help="words per user turn")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    parser.add_argument("--context", type=int, default=8192, help="tokens per request")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="llama.cpp threads per agent (default 1: the two agents of a mode share 2 cores)",
    )
    parser.add_argument("--slots", type=int, default=2, help="llama-server slots per agent")
    parser.add_argument("--singles", type=int, default=8)
    parser.add_argument("--warm-rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--var-dir", default="var/bench/conversations")
    parser.add_argument(
        "--output", help="the JSON result (default: var/bench/conversations-*.json)"
    )
    args = parser.parse_args(argv)
    for name in ("conversations", "turns", "system_tokens", "user_tokens", "max_tokens", "slots"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    output = Path(args.output or f"var/bench/conversations-{stamp}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(stats.json_safe(result), indent=2))
    print(report(result))
    print(f"\n(written to {output})")
    failed = sum(m["failed"] for m in result["modes"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
