"""Capacity benchmark: one controller on Postgres + Redis, synthetic agents, many streams.

    python -m bench.capacity            # full size: 100 nodes x 4 slots, 800 streams x 500 tokens
    python -m bench.capacity --quick    # a small run (what the test suite runs)

Three measurements, each with its threshold:

1. **Streams.** ``--nodes`` synthetic agents (``bench/synthetic_agents.py``: the real control
   protocol, no llama.cpp) with ``--slots`` each serve ``--streams`` concurrent streaming chat
   completions of ``--tokens`` tokens, sent all at once by raw HTTP clients
   (``bench/raw_sse_client.py``: asyncio streams, no HTTP library, so the clients take little
   of the CPU); with the defaults half of them queue. Reported: tokens/s relayed (all tokens of
   all streams over the wall time), the controller's CPU per token (user + system of its
   process), added time to first token (client TTFT minus the job's queue wait) and queue wait
   p50/p99, event appends/s, failures (must be 0), every token recorded (the jobs'
   ``tokens_streamed``), and FIFO (per model, JOB_DISPATCHED order equals JOB_QUEUED order).
2. **Idle heartbeats.** ``--idle-nodes`` agents holding nothing heartbeat at the controller's
   default interval; the controller's CPU over ``--idle-seconds`` as a share of one core.
3. **Scheduler decisions** with 1,000 nodes in the read model (``bench/scheduler_decisions``).

Prints a table and writes JSON to ``var/bench/``; exits 1 when a threshold is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

from application.controller import Controller as ControllerApp
from bench import scheduler_decisions, stats
from bench.raw_sse_client import StreamResult, stream_chat
from infrastructure.persistence import persistence_env
from infrastructure.read_model_store import open_read_model

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "synthetic"
MODEL_SHA = "5e" * 32
MIB = 1 << 20
EVENTS_TABLE = f"{ControllerApp.name.lower()}_events"  # eventsourcing's table name

THRESHOLDS = {
    "tokens_per_second": 5000.0,  # at least
    "idle_core_share": 0.15,  # at most
    "scheduler_p99_ms": 5.0,  # at most
}


@dataclass
class Report:
    date: str
    machine: str
    store: str
    live_state: str
    transport: str
    nodes: int
    slots: int
    streams: int
    tokens_per_stream: int
    tokens_per_message: int
    message_interval_s: float
    wall_s: float = 0.0
    tokens_relayed: int = 0
    tokens_per_second: float = 0.0
    controller_cpu_s: float = 0.0
    controller_cpu_ms_per_token: float = 0.0
    agents_cpu_s: float = 0.0
    clients_cpu_s: float = 0.0
    added_ttft_ms: dict[str, float] = field(default_factory=dict)
    queue_wait_ms: dict[str, float] = field(default_factory=dict)
    queued_jobs: int = 0
    event_appends_per_second: float = 0.0
    failures: int = 0
    failure_examples: list[str] = field(default_factory=list)
    tokens_recorded: int = 0
    fifo_kept: bool = False
    idle_nodes: int = 0
    idle_heartbeats_per_second: float = 0.0
    idle_core_share: float = 0.0
    scheduler: dict[str, Any] = field(default_factory=dict)
    verdicts: dict[str, bool] = field(default_factory=dict)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Controller:
    """The controller process under test."""

    def __init__(
        self,
        database_url: str,
        redis_url: str,
        var_dir: Path,
        extra_env: dict[str, str] | None = None,
        source: Path | None = None,
    ) -> None:
        """``database_url`` "" runs the embedded defaults (SQLite under ``var_dir``, live state
        in process) and ignores ``redis_url``. ``source``: the checkout whose code runs (None:
        this one), to compare two versions side by side."""
        self.source = source
        self.schema = f"bench_{uuid.uuid4().hex[:10]}"
        self.database_url = database_url
        self.port, self.grpc_port = _free_port(), _free_port()
        self.ai_key, self.admin_key = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        stores = (
            {
                "DATABASE_URL": f"{database_url}?schema={self.schema}",
                "REDIS_URL": redis_url,
                "REDIS_KEY_PREFIX": f"dacp-bench:{self.schema}:",
            }
            if database_url
            else {}
        )
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
            **stores,
            "PORT": str(self.port),
            "GRPC_PORT": str(self.grpc_port),
            # Synthetic agents fetch no model: no model store port to collide with another's.
            "MODEL_STORE_PORT": "off",
            "AI_API_KEY": self.ai_key,
            "ADMIN_API_KEY": self.admin_key,
            "NODE_ENROLLMENT_SECRET": secrets.token_urlsafe(16),
            "QUEUE_TIMEOUT": "900",
            "QUEUE_MAX": "100000",
            "DACP_VAR_DIR": str(var_dir),
            # Its own config file (written at its first start): never the operator's.
            "DACP_CONFIG": str(var_dir / "config.toml"),
            "DACP_URL": f"http://127.0.0.1:{self.port}",
            **(extra_env or {}),
        }
        #: The controller's CA: the synthetic agents verify it over TLS, as real ones do.
        self.ca_file = var_dir / "tls" / "ca.pem"
        self.log = (var_dir / "controller.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "interfaces.cli.main", "controller", "--log-level", "warning"],
            env=self.env,
            cwd=source,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.process = psutil.Process(self.proc.pid)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                # The log lives in a temporary folder that goes with the run: say its end here.
                self.log.flush()
                tail = Path(self.log.name).read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(
                    f"the controller did not start (exit code {self.proc.poll()}); the end of "
                    f"its log:\n" + "\n".join(tail)
                )
            time.sleep(0.2)

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def cpu_seconds(self) -> float:
        times = self.process.cpu_times()
        return float(times.user + times.system)

    def token(self) -> str:
        return subprocess.run(
            [sys.executable, "-m", "interfaces.cli.main", "token", "create", "--multi-use"],
            env=self.env,
            cwd=self.source,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    def nodes(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        rows = httpx.get(f"{self.url}/api/admin/nodes", headers=self.admin, timeout=30)
        out.extend(rows.json()["data"])
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        if not self.database_url:
            return
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')  # type: ignore[arg-type]


class Agents:
    """A process of synthetic agents."""

    def __init__(self, ctl: Controller, token: str, count: int, *args: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.synthetic_agents",
                "--target",
                f"127.0.0.1:{ctl.grpc_port}",
                "--token",
                token,
                "--ca-file",
                str(ctl.ca_file),
                "--count",
                str(count),
                *args,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != f"ready {count}":
            self.proc.kill()
            raise RuntimeError(f"synthetic agents did not connect: {line!r}")

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        return dict(json.loads(lines[-1])) if lines else {}


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _wait(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


async def _stream(ctl: Controller, index: int, tokens: int) -> StreamResult:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"stream {index}"}],
        "stream": True,
        "max_tokens": tokens,
    }
    return await stream_chat("127.0.0.1", ctl.port, ctl.ai_key, body)


async def _load(ctl: Controller, streams: int, tokens: int) -> list[StreamResult]:
    return list(await asyncio.gather(*(_stream(ctl, i, tokens) for i in range(streams))))


def _job_id(completion_id: str) -> str:
    """The job id inside an OpenAI completion id ("" when there is none)."""
    return str(uuid.UUID(completion_id.removeprefix("chatcmpl-"))) if completion_id else ""


def _store_scan(ctl: Controller) -> tuple[list[str], list[str]]:
    """Job ids in JOB_QUEUED order and in JOB_DISPATCHED order (store positions)."""
    with psycopg.connect(ctl.database_url, autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT topic, originator_id FROM "{ctl.schema}".{EVENTS_TABLE} '  # type: ignore[arg-type]
            "WHERE topic LIKE '%Job.Queued' OR topic LIKE '%Job.Dispatched' "
            "ORDER BY notification_id"
        ).fetchall()
    queued = [str(r[1]) for r in rows if r[0].endswith("Queued")]
    dispatched = [str(r[1]) for r in rows if r[0].endswith("Dispatched")]
    return queued, dispatched


def _max_position(ctl: Controller) -> int:
    with psycopg.connect(ctl.database_url, autocommit=True) as conn:
        row = conn.execute(
            f'SELECT COALESCE(MAX(notification_id), 0) FROM "{ctl.schema}".{EVENTS_TABLE}'  # type: ignore[arg-type]
        ).fetchone()
    return int(row[0]) if row else 0


def run_streams(ctl: Controller, args: argparse.Namespace, report: Report) -> None:
    token = ctl.token()
    agents = Agents(
        ctl,
        token,
        args.nodes,
        "--holds",
        MODEL_SHA,
        "--slots",
        str(args.slots),
        "--tokens",
        str(args.tokens),
        "--tokens-per-message",
        str(args.tokens_per_message),
        "--message-interval",
        str(args.message_interval),
    )
    response = httpx.post(
        f"{ctl.url}/api/admin/models",
        headers=ctl.admin,
        json={"name": MODEL, "sha256": MODEL_SHA, "file_name": "m.gguf", "context_size": 2048},
        timeout=30,
    )
    response.raise_for_status()

    def ready() -> bool:
        rows = ctl.nodes()
        ready = sum(1 for r in rows if r["state"] == "READY" and r["local_models"])
        return bool(ready == args.nodes)

    _wait("every synthetic node READY with the model", ready, 120)
    time.sleep(2 * 1.0)  # two live-state flushes: every node's heartbeat is visible
    position, cpu = _max_position(ctl), ctl.cpu_seconds()
    others = _cpu_seconds(psutil.Process(agents.proc.pid)), _cpu_seconds(psutil.Process())
    started = time.perf_counter()
    results = asyncio.run(_load(ctl, args.streams, args.tokens))
    report.wall_s = time.perf_counter() - started
    report.controller_cpu_s = ctl.cpu_seconds() - cpu
    report.agents_cpu_s = _cpu_seconds(psutil.Process(agents.proc.pid)) - others[0]
    report.clients_cpu_s = _cpu_seconds(psutil.Process()) - others[1]
    appended = _max_position(ctl) - position
    agents.stop()

    failed = [r for r in results if r.status != 200 or r.error or r.tokens != args.tokens]
    report.failures = len(failed)
    report.failure_examples = [
        f"status {r.status}, {r.tokens} tokens, {r.error[:120]}" for r in failed[:5]
    ]
    report.tokens_relayed = sum(r.tokens for r in results)
    report.tokens_per_second = report.tokens_relayed / report.wall_s
    report.controller_cpu_ms_per_token = (
        1000 * report.controller_cpu_s / max(1, report.tokens_relayed)
    )
    report.event_appends_per_second = appended / report.wall_s

    time.sleep(2.0)  # the views follow the store
    views = open_read_model(persistence_env(ctl.database_url, schema=ctl.schema))
    waits: dict[str, float] = {}
    recorded = 0
    for r in results:
        job_id = _job_id(r.completion_id)
        row = views.get_job(job_id) if job_id else None
        if row is None:
            continue
        recorded += int(row["tokens_streamed"])
        if row["queued_at"] and row["planned_at"]:
            waits[job_id] = (
                dt.datetime.fromisoformat(row["planned_at"])
                - dt.datetime.fromisoformat(row["queued_at"])
            ).total_seconds()
    report.tokens_recorded = recorded
    report.queued_jobs = len(waits)
    queue_ms = [1000 * w for w in waits.values()] or [0.0]
    added = []
    for r in results:
        if r.ttft is None:
            continue
        job_id = _job_id(r.completion_id)
        added.append(1000 * (r.ttft - waits.get(job_id, 0.0)))
    report.queue_wait_ms = {
        "p50": stats.percentile(queue_ms, 50),
        "p99": stats.percentile(queue_ms, 99),
    }
    report.added_ttft_ms = {"p50": stats.percentile(added, 50), "p99": stats.percentile(added, 99)}
    queued, dispatched = _store_scan(ctl)
    queued_set = set(queued)
    report.fifo_kept = [j for j in dispatched if j in queued_set] == queued


def _views_caught_up(ctl: Controller) -> bool:
    """Whether the controller's views have applied every stored event."""
    with psycopg.connect(ctl.database_url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = %s AND table_name LIKE %s",
            (ctl.schema, "%tracking%"),
        ).fetchall()
        applied = 0
        for (table,) in tables:
            row = conn.execute(
                f'SELECT COALESCE(MAX(notification_id), 0) FROM "{ctl.schema}"."{table}"'  # type: ignore[arg-type]
            ).fetchone()
            applied = max(applied, int(row[0]) if row else 0)
    return applied >= _max_position(ctl)


def run_idle(ctl: Controller, args: argparse.Namespace, report: Report) -> None:
    agents = Agents(ctl, ctl.token(), args.idle_nodes, "--name-prefix", "idle-")
    # Enrolling a thousand nodes writes thousands of events: measure once they are applied.
    _wait("the views to apply the enrolments", lambda: _views_caught_up(ctl), 300)
    time.sleep(args.idle_settle)
    cpu, started = ctl.cpu_seconds(), time.perf_counter()
    time.sleep(args.idle_seconds)
    report.idle_core_share = (ctl.cpu_seconds() - cpu) / (time.perf_counter() - started)
    totals = agents.stop()
    report.idle_nodes = args.idle_nodes
    report.idle_heartbeats_per_second = totals.get("heartbeats", 0) / max(
        1.0, args.idle_settle + args.idle_seconds
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity")
    parser.add_argument("--quick", action="store_true", help="a small run for the test suite")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--streams", type=int, default=800)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--tokens-per-message", type=int, default=4)
    parser.add_argument("--message-interval", type=float, default=0.2)
    parser.add_argument("--idle-nodes", type=int, default=1000)
    parser.add_argument("--idle-settle", type=float, default=10.0)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--scheduler-nodes", type=int, default=1000)
    parser.add_argument(
        "--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)
    )
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS_URL))
    parser.add_argument("--out", type=Path, default=Path("var/bench"))
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.streams, args.tokens = 4, 32, 100
        args.message_interval, args.idle_nodes = 0.05, 50
        args.idle_settle, args.idle_seconds, args.scheduler_nodes = 3.0, 3.0, 200

    report = Report(
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {psutil.cpu_count()} cores, {_cpu_model()}",
        store="PostgreSQL",
        live_state="Redis (write-behind)",
        transport="gRPC over TLS (the controller's own CA, pinned) on loopback / HTTP SSE",
        nodes=args.nodes,
        slots=args.slots,
        streams=args.streams,
        tokens_per_stream=args.tokens,
        tokens_per_message=args.tokens_per_message,
        message_interval_s=args.message_interval,
    )
    with tempfile.TemporaryDirectory(prefix="dacp-capacity-") as tmp:
        ctl = Controller(args.database_url, args.redis_url, Path(tmp))
        try:
            print(
                f"streams: {args.nodes} nodes x {args.slots} slots, {args.streams} streams",
                flush=True,
            )
            run_streams(ctl, args, report)
            print(f"idle: {args.idle_nodes} nodes heartbeating", flush=True)
            run_idle(ctl, args, report)
        finally:
            ctl.stop()
    report.scheduler = scheduler_decisions.measure(args.scheduler_nodes)
    report.verdicts = {
        "no failures": report.failures == 0,
        "every token recorded": report.tokens_recorded == args.streams * args.tokens,
        "FIFO kept": report.fifo_kept,
        f"tokens/s >= {THRESHOLDS['tokens_per_second']:g}": args.quick
        or report.tokens_per_second >= THRESHOLDS["tokens_per_second"],
        f"idle heartbeats < {THRESHOLDS['idle_core_share']:.0%} of a core": report.idle_core_share
        < THRESHOLDS["idle_core_share"],
        f"scheduler p99 <= {THRESHOLDS['scheduler_p99_ms']:g} ms": report.scheduler["p99_ms"]
        <= THRESHOLDS["scheduler_p99_ms"],
    }
    _print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"capacity-{stamp}.json"
    path.write_text(json.dumps(asdict(report), indent=2))
    print(f"written to {path}")
    return 0 if all(report.verdicts.values()) else 1


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _print(r: Report) -> None:
    ttft, wait, sched = r.added_ttft_ms, r.queue_wait_ms, r.scheduler
    rows = [
        ("date", r.date),
        ("machine", r.machine),
        ("store / live state", f"{r.store} / {r.live_state}"),
        ("transport", r.transport),
        ("nodes", f"{r.nodes} x {r.slots} slots"),
        ("streams", f"{r.streams} x {r.tokens_per_stream} tokens"),
        ("tokens per message", f"{r.tokens_per_message} every {r.message_interval_s * 1000:g} ms"),
        ("wall time", f"{r.wall_s:.1f} s"),
        ("tokens relayed", f"{r.tokens_relayed} ({r.tokens_per_second:,.0f} tok/s)"),
        ("controller CPU", f"{r.controller_cpu_s:.1f} s"),
        ("synthetic agents CPU", f"{r.agents_cpu_s:.1f} s (same 2 cores)"),
        ("HTTP clients CPU", f"{r.clients_cpu_s:.1f} s (same 2 cores)"),
        ("controller CPU/token", f"{r.controller_cpu_ms_per_token:.4f} ms"),
        ("added TTFT p50 / p99", f"{ttft['p50']:.1f} / {ttft['p99']:.1f} ms"),
        ("queue wait p50 / p99", f"{wait['p50']:.0f} / {wait['p99']:.0f} ms"),
        ("queued jobs", str(r.queued_jobs)),
        ("event appends", f"{r.event_appends_per_second:,.0f} /s"),
        ("failures", str(r.failures)),
        *(("  e.g.", example) for example in r.failure_examples),
        ("tokens recorded", str(r.tokens_recorded)),
        ("FIFO kept", str(r.fifo_kept)),
        ("idle nodes", f"{r.idle_nodes} ({r.idle_heartbeats_per_second:.0f} heartbeats/s)"),
        ("idle controller CPU", f"{r.idle_core_share:.1%} of one core"),
        ("scheduler nodes", str(sched["nodes"])),
        ("scheduler warm p50/p99", f"{sched['warm_p50_ms']:.2f} / {sched['warm_p99_ms']:.2f} ms"),
        ("scheduler cold p50/p99", f"{sched['cold_p50_ms']:.2f} / {sched['cold_p99_ms']:.2f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")
    for verdict, ok in r.verdicts.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
