"""What the controller adds to a warm one-node request's time to first token, without llama.cpp.

Two paths (three with ``--baseline``), their requests interleaved (the order rotated every
round, so drifts in machine load hit every path alike), each read by the same raw client
(``bench/raw_sse_client.py``):

* ``direct``: a stand-in for llama-server, a few lines of asyncio that answer a streamed chat
  completion with its first token ``--first-token-ms`` after the request;
* ``controller``: the controller and one synthetic agent (``bench/synthetic_agents.py``: the
  real control protocol) whose first token goes out ``--first-token-ms`` after the plan
  arrives. After a warm-up request its server is warm, so every measured request takes the warm
  one-node path, where the dispatch is recorded while the agent works;
* ``baseline`` (``--baseline DIR``): the same with the controller of another checkout (a
  ``git worktree`` of an earlier commit, say), so that two versions are compared in one run;
* ``managed`` (``--managed-key``): this checkout's controller again, asked with a managed key
  (``sk-dacp-…``, made through the admin API) instead of ``AI_API_KEY``: what checking a
  managed key against the event store adds to every request of a team.

The paired difference to ``direct`` is what the controller and the two gRPC hops add (the real
agent adds its own setup and the HTTP exchange with llama-server on top: ``bench/compare_paths``
measures that whole path with llama.cpp, whose own time varies far more than this). Results: a
table and a JSON file under ``var/bench/``.

    python -m bench.hot_path                    # 300 rounds, the embedded store
    python -m bench.hot_path --baseline /tmp/base
    python -m bench.hot_path --managed-key
    python -m bench.hot_path --database-url postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from bench import capacity, stats
from bench.capacity import MODEL, MODEL_SHA, Agents, Controller
from bench.raw_sse_client import TOKEN, StreamResult, stream_chat

DIRECT = "direct"


@dataclass
class PathReport:
    ttft_ms: dict[str, float] = field(default_factory=dict)
    #: Paired with the direct request of the same round.
    added_ms: dict[str, float] = field(default_factory=dict)
    #: The controller's CPU over the rounds, per request it served (None: a path that shares
    #: its controller with another, ``managed``).
    controller_cpu_ms_per_request: float | None = None


@dataclass
class Report:
    date: str
    machine: str
    store: str
    rounds: int
    first_token_ms: float
    baseline: str = ""
    direct_ms: dict[str, float] = field(default_factory=dict)
    paths: dict[str, PathReport] = field(default_factory=dict)
    #: controller minus baseline, paired per round (with --baseline).
    controller_minus_baseline_ms: dict[str, float] = field(default_factory=dict)
    #: managed minus controller, paired per round (with --managed-key).
    managed_minus_controller_ms: dict[str, float] = field(default_factory=dict)
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


MANAGED = "managed"


async def _rounds(
    paths: dict[str, tuple[Controller, str]], rounds: int, pause: float, first_token: float
) -> dict[str, list[StreamResult]]:
    """Each round asks every path once (direct first on round 0, the order rotated every
    round); ``paths`` maps a name to the controller it asks and the key it asks with."""
    server = await asyncio.start_server(
        functools.partial(_stand_in, first_token=first_token), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    names = [DIRECT, *paths]
    results: dict[str, list[StreamResult]] = {name: [] for name in names}
    async with server:
        for ctl, key in paths.values():  # warms each server (and the key's first check)
            await stream_chat("127.0.0.1", ctl.port, key, _body(-1))
        for index in range(rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                if name == DIRECT:
                    result = await stream_chat("127.0.0.1", port, "-", _body(index))
                else:
                    ctl, key = paths[name]
                    result = await stream_chat("127.0.0.1", ctl.port, key, _body(index))
                results[name].append(result)
                # A request's ending is recorded after its answer; a real answer takes longer
                # than this one, so the next request does not meet that work.
                await asyncio.sleep(pause)
    return results


def _managed_key(ctl: Controller) -> str:
    """A new managed key of ``ctl``, every model, no limits (its text)."""
    answer = httpx.post(
        f"{ctl.url}/api/admin/api-keys/", headers=ctl.admin, json={"name": "bench"}, timeout=30
    )
    answer.raise_for_status()
    return str(answer.json()["key"])


def _ready(ctl: Controller) -> bool:
    rows = ctl.nodes()
    return any(r["state"] == "READY" and r["local_models"] for r in rows)


@contextlib.contextmanager
def _cluster(args: argparse.Namespace, var_dir: Path, source: Path | None) -> Iterator[Controller]:
    """A controller (of the checkout ``source``) with one synthetic agent, its model ready."""
    var_dir.mkdir(parents=True, exist_ok=True)
    ctl = Controller(args.database_url, args.redis_url, var_dir, source=source)
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
            yield ctl
        finally:
            agents.stop()
    finally:
        ctl.stop()


def run(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="dacp-hot-path-") as tmp, contextlib.ExitStack() as up:
        controllers = {"controller": up.enter_context(_cluster(args, Path(tmp) / "a", None))}
        if args.baseline is not None:
            baseline = up.enter_context(_cluster(args, Path(tmp) / "b", args.baseline))
            controllers["baseline"] = baseline
        paths = {name: (ctl, ctl.ai_key) for name, ctl in controllers.items()}
        if args.managed_key:
            paths[MANAGED] = (controllers["controller"], _managed_key(controllers["controller"]))
        time.sleep(2.0)  # two live-state flushes: every agent's heartbeat is visible
        cpu = {name: ctl.cpu_seconds() for name, ctl in controllers.items()}
        results = asyncio.run(_rounds(paths, args.rounds, args.pause, args.first_token_ms / 1000))
        for name in paths:
            report.paths[name] = PathReport()
        for name, ctl in controllers.items():
            served = args.rounds * sum(1 for asked, _ in paths.values() if asked is ctl)
            spent = (ctl.cpu_seconds() - cpu[name]) * 1000 / served
            report.paths[name].controller_cpu_ms_per_request = round(spent, 3)
    names = [DIRECT, *paths]
    ok = [
        {name: results[name][i].ttft for name in names}
        for i in range(args.rounds)
        if all(results[name][i].ttft is not None and not results[name][i].error for name in names)
    ]
    report.failures = args.rounds - len(ok)
    if not ok:
        first = {name: results[name][0] for name in names}
        raise SystemExit(f"no round succeeded: {first}")

    def ms(name: str, row: dict[str, float | None]) -> float:
        value = row[name]
        assert value is not None
        return value * 1000

    report.direct_ms = _summary([ms(DIRECT, row) for row in ok])
    for name in paths:
        report.paths[name].ttft_ms = _summary([ms(name, row) for row in ok])
        report.paths[name].added_ms = _summary([ms(name, row) - ms(DIRECT, row) for row in ok])
    if "baseline" in controllers:
        report.controller_minus_baseline_ms = _summary(
            [ms("controller", row) - ms("baseline", row) for row in ok]
        )
    if MANAGED in paths:
        report.managed_minus_controller_ms = _summary(
            [ms(MANAGED, row) - ms("controller", row) for row in ok]
        )


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(stats.percentile(values, 50), 3),
        "p95": round(stats.percentile(values, 95), 3),
        "mean": round(sum(values) / len(values), 3),
    }


def _print(report: Report) -> None:
    print(
        f"{report.rounds} rounds, first token after {report.first_token_ms:g} ms, "
        f"{report.store}, {report.machine}"
    )
    if report.baseline:
        print(f"baseline: the controller of {report.baseline}")
    print(f"{'TTFT (ms)':<34}{'p50':>9}{'p95':>9}{'mean':>9}")
    rows = [("direct (stand-in server)", report.direct_ms)]
    shown = {MANAGED: "controller, managed key"}
    for name, path in report.paths.items():
        rows.append((f"{shown.get(name, name)} + synthetic agent", path.ttft_ms))
    for name, path in report.paths.items():
        rows.append((f"added by the {shown.get(name, name)}", path.added_ms))
    if report.controller_minus_baseline_ms:
        rows.append(("controller - baseline (paired)", report.controller_minus_baseline_ms))
    if report.managed_minus_controller_ms:
        rows.append(("managed - controller (paired)", report.managed_minus_controller_ms))
    for label, row in rows:
        print(f"{label:<34}{row['p50']:>9.3f}{row['p95']:>9.3f}{row['mean']:>9.3f}")
    for name, path in report.paths.items():
        if path.controller_cpu_ms_per_request is not None:
            print(f"{name} CPU per request: {path.controller_cpu_ms_per_request:.3f} ms")
    print(f"failed rounds: {report.failures}")


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
        "--baseline",
        type=Path,
        default=None,
        help="another checkout (e.g. a git worktree of an earlier commit) whose controller "
        "runs side by side with this one's",
    )
    parser.add_argument(
        "--managed-key",
        action="store_true",
        help="also ask this checkout's controller with a managed key (path 'managed')",
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
    if args.baseline is not None and not (args.baseline / "interfaces").is_dir():
        parser.error(f"--baseline {args.baseline}: not a checkout of this project")
    report = Report(
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {psutil.cpu_count()} cores",
        store="PostgreSQL + Redis" if args.database_url else "embedded (SQLite)",
        rounds=args.rounds,
        first_token_ms=args.first_token_ms,
        baseline=str(args.baseline or ""),
    )
    run(args, report)
    _print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"hot-path-{stamp}.json"
    path.write_text(json.dumps(asdict(report), indent=2))
    print(f"written to {path}")
    return 0 if report.failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
