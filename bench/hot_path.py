"""What the controller adds to a warm one-node request's time to first token, without llama.cpp.

Two paths, their requests interleaved (the order swapped on every other round, so drifts in
machine load hit both alike), each read by the same raw client (``bench/raw_sse_client.py``):

* ``direct``: a stand-in for llama-server, a few lines of asyncio that answer a streamed chat
  completion with its first token ``--first-token-ms`` after the request;
* ``controller``: the controller and one synthetic agent (``bench/synthetic_agents.py``: the
  real control protocol) whose first token goes out ``--first-token-ms`` after the plan
  arrives. After a warm-up request its server is warm, so every measured request takes the warm
  one-node path, where the dispatch is recorded while the agent works.

The paired difference of the two is what the controller and the two gRPC hops add (the real
agent adds its own setup and the HTTP exchange with llama-server on top: ``bench/compare_paths``
measures that whole path with llama.cpp, whose own time varies far more than this). Results: a
table and a JSON file under ``var/bench/``.

    python -m bench.hot_path                    # 300 rounds, the embedded store
    python -m bench.hot_path --database-url postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from bench import capacity, stats
from bench.capacity import MODEL, MODEL_SHA, Agents, Controller
from bench.raw_sse_client import TOKEN, StreamResult, stream_chat


@dataclass
class Report:
    date: str
    machine: str
    store: str
    rounds: int
    direct_ms: dict[str, float] = field(default_factory=dict)
    controller_ms: dict[str, float] = field(default_factory=dict)
    added_ms: dict[str, float] = field(default_factory=dict)
    controller_cpu_ms_per_request: float = 0.0
    failures: int = 0


def _chunk(payload: dict[str, Any]) -> bytes:
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _stand_in(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first_token: float
) -> None:
    """One streamed chat completion, its first token after ``first_token`` seconds (the
    prompt's processing), ``Connection: close``."""
    try:
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        orjson.loads(await reader.readexactly(length))
        await asyncio.sleep(first_token)
        base = {"id": "chatcmpl-direct", "object": "chat.completion.chunk", "model": MODEL}
        first = {**base, "choices": [{"index": 0, "delta": {"content": TOKEN.decode()}}]}
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + _chunk(first)
        )
        await writer.drain()
        last = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        writer.write(_chunk(last) + b"0\r\n\r\n")
        await writer.drain()
    finally:
        writer.close()


def _body(index: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {index}"}],
        "stream": True,
        "max_tokens": 1,
    }


async def _rounds(
    ctl: Controller, rounds: int, pause: float, first_token: float
) -> tuple[list[StreamResult], list[StreamResult]]:
    server = await asyncio.start_server(
        functools.partial(_stand_in, first_token=first_token), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    direct: list[StreamResult] = []
    through: list[StreamResult] = []
    async with server:
        await stream_chat("127.0.0.1", ctl.port, ctl.ai_key, _body(-1))  # warms the server
        for index in range(rounds):
            order = ["direct", "controller"] if index % 2 == 0 else ["controller", "direct"]
            for path in order:
                if path == "direct":
                    direct.append(await stream_chat("127.0.0.1", port, "-", _body(index)))
                else:
                    through.append(
                        await stream_chat("127.0.0.1", ctl.port, ctl.ai_key, _body(index))
                    )
                # A request's ending is recorded after its answer; a real answer takes longer
                # than this one, so the next request does not meet that work.
                await asyncio.sleep(pause)
    return direct, through


def _ready(ctl: Controller) -> bool:
    rows = ctl.nodes()
    return any(r["state"] == "READY" and r["local_models"] for r in rows)


def run(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="dacp-hot-path-") as tmp:
        ctl = Controller(args.database_url, args.redis_url, Path(tmp))
        try:
            agents = Agents(
                ctl,
                ctl.token(),
                1,
                "--holds",
                MODEL_SHA,
                "--slots",
                "4",
                "--tokens",
                "1",
                "--first-token-delay",
                str(args.first_token_ms / 1000),
            )
            try:
                httpx.post(
                    f"{ctl.url}/api/admin/models",
                    headers=ctl.admin,
                    json={
                        "name": MODEL,
                        "sha256": MODEL_SHA,
                        "file_name": "m.gguf",
                        "context_size": 2048,
                    },
                    timeout=30,
                ).raise_for_status()
                capacity._wait("the synthetic node READY with the model", lambda: _ready(ctl), 60)
                time.sleep(2.0)  # two live-state flushes: its heartbeat is visible
                cpu = ctl.cpu_seconds()
                direct, through = asyncio.run(
                    _rounds(ctl, args.rounds, args.pause, args.first_token_ms / 1000)
                )
                report.controller_cpu_ms_per_request = (
                    (ctl.cpu_seconds() - cpu) * 1000 / max(len(through), 1)
                )
            finally:
                agents.stop()
        finally:
            ctl.stop()
    ok = [
        (d.ttft, t.ttft)
        for d, t in zip(direct, through, strict=True)
        if d.ttft is not None and t.ttft is not None and not d.error and not t.error
    ]
    report.failures = 2 * len(direct) - 2 * len(ok)
    if not ok:
        raise SystemExit(f"no request succeeded: {direct[:1]} {through[:1]}")
    report.direct_ms = _summary([d * 1000 for d, _ in ok])
    report.controller_ms = _summary([t * 1000 for _, t in ok])
    report.added_ms = _summary([(t - d) * 1000 for d, t in ok])


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(stats.percentile(values, 50), 3),
        "p95": round(stats.percentile(values, 95), 3),
        "mean": round(sum(values) / len(values), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_path")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument(
        "--first-token-ms",
        type=float,
        default=20.0,
        help="both paths' time from the request to the first token, as a server's prompt "
        "processing (default 20: the controller's store writes overlap it, as with llama.cpp)",
    )
    parser.add_argument(
        "--pause", type=float, default=0.05, help="seconds between requests (default 0.05)"
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", ""),
        help="PostgreSQL (with --redis-url); empty: the embedded defaults (SQLite)",
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("BENCH_REDIS_URL", capacity.DEFAULT_REDIS_URL)
    )
    parser.add_argument("--out", type=Path, default=Path("var/bench"))
    args = parser.parse_args(argv)
    report = Report(
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {psutil.cpu_count()} cores",
        store="PostgreSQL + Redis" if args.database_url else "embedded (SQLite)",
        rounds=args.rounds,
    )
    run(args, report)
    print(f"{report.rounds} rounds, {report.store}, {report.machine}")
    print(f"{'TTFT (ms)':<28}{'p50':>9}{'p95':>9}{'mean':>9}")
    for label, row in (
        ("direct (stand-in server)", report.direct_ms),
        ("controller + synthetic agent", report.controller_ms),
        ("added by the controller", report.added_ms),
    ):
        print(f"{label:<28}{row['p50']:>9.3f}{row['p95']:>9.3f}{row['mean']:>9.3f}")
    print(f"controller CPU per request: {report.controller_cpu_ms_per_request:.3f} ms")
    print(f"failures: {report.failures}")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"hot-path-{stamp}.json"
    path.write_text(json.dumps(asdict(report), indent=2))
    print(f"written to {path}")
    return 0 if report.failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
