"""Direct llama-server versus the same model through the controller, in one interleaved run.

Paths (all serve the cached SmolLM2-135M GGUF, all are streamed with the same OpenAI SDK code):

* ``a``  -- one ``llama-server`` started with the agent's runtime modules, queried directly;
* ``b1`` -- a local cluster with ONE agent holding the model and a large memory limit, so the
  plan is one node: the difference to ``a`` is the controller + agent overhead;
* ``b2`` -- the default two-agent local cluster (each agent offers 160 MiB), so every request
  is split over two nodes via llama.cpp RPC;
* ``c``  -- one ``llama-server`` split over local ``ggml-rpc-server`` processes with the same
  ``--tensor-split`` (and context, layers, threads) the ``b2`` primary was started with, read
  from its log: the like-for-like direct baseline for ``b2``;
* ``cg`` -- ``c`` with each ``ggml-rpc-server`` gated as an agent gates it (the accept filter of
  ``agent/runtime/rpc_filter.py``, letting in 127.0.0.1 only): ``cg/c`` is the gate's own cost;
* ``cl`` -- ``c`` over an emulated 1 GbE LAN: each ``ggml-rpc-server`` in a network namespace
  of its own behind a veth shaped by ``tbf`` to 1 Gbit/s, with 0.2 ms added round trip
  (:mod:`bench.emulated_lan`): ``cl/c`` is what the network costs a split's decode. Needs root
  and iproute2; without them it is skipped (one line says why) and the other paths run.

``a`` likewise mirrors the settings of the ``b1`` agent's ``llama-server``. Each path gets one
warm-up request (not counted; its time to first token includes any model load), then the
prompts go round-robin over the paths, the order reversed on every other prompt (a, b1, c, b2,
then b2, c, b1, a, ...) so drifts in machine load hit every path alike.

Per request: time to first token (client side, from sending the request to the first non-empty
content delta) and tokens/s (``usage.completion_tokens`` from the stream's usage chunk divided
by the time from the first to the last content delta). Results: a table, the ratios
(controller / direct), and a JSON file under ``var/bench/``.

    python -m bench.compare_paths                # 30 prompts x 64 tokens, all paths
    python -m bench.compare_paths --quick        # 3 prompts x 16 tokens
    python -m bench.compare_paths --paths a,c    # direct paths only
    python -m bench.compare_paths --paths c,cl --lan-rtt-ms 0   # the shaping alone
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psutil
from openai import OpenAI, OpenAIError
from openai.types.chat import ChatCompletionMessageParam

from agent.runtime import (
    llama_binaries,
    llama_server,
    managed_child,
    rpc_worker,
    runtime_errors,
    server_spec,
)
from agent.runtime.endpoints import free_loopback_port
from agent.runtime.llama_backend import choose_backend
from agent.runtime.rpc_filter import PeerFilter
from bench import emulated_lan, stats
from ops import artifacts, paths
from ops.local_cluster import (
    DEFAULT_MEMORY_LIMIT,
    MODEL_NAME,
    AgentSpec,
    ClusterConfig,
    LocalCluster,
)

LOOPBACK = "127.0.0.1"
PATH_ORDER = ("a", "b1", "c", "cg", "cl", "b2")
CONTROLLER_PATHS = frozenset({"b1", "b2"})
LABELS = {
    "a": "direct llama-server, one process",
    "b1": "controller -> 1 agent (one-node plan)",
    "c": "direct llama-server split over local RPC",
    "cg": "c, RPC workers behind the agent's accept filter",
    "cl": "c, RPC workers over an emulated 1 GbE LAN",
    "b2": "controller -> 2 agents (RPC split)",
}
#: (numerator, denominator, meaning) -- the ratios printed, controller over direct first.
COMPARISONS = (
    ("b1", "a", "controller+agent overhead, one node"),
    ("b2", "c", "controller+agents overhead, two-node split"),
    ("c", "a", "RPC split cost without the controller"),
    ("cg", "c", "the agent's RPC worker gate (accept filter)"),
    ("cl", "c", "decode over an emulated 1 GbE LAN vs loopback"),
)

PROMPTS = (
    "Name three primary colors.",
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Explain what a CPU does in simple terms.",
    "List four animals that live on a farm.",
    "Give me a short tip for staying healthy.",
    "What does a librarian do?",
    "Describe the color blue to a child.",
    "Why do leaves change color in autumn?",
    "Suggest a name for a friendly robot.",
    "What is two plus two? Answer in words.",
    "Tell me a fun fact about the moon.",
)

#: The issue asks for at least 30 paired prompts per comparison.
DEFAULT_PROMPTS = 30
SOLO_MEMORY_LIMIT = 4 * 1024 * 1024 * 1024
REQUEST_TIMEOUT = 300.0
#: Give up on a path after this many failed requests in a row.
MAX_CONSECUTIVE_ERRORS = 3
_LOG_TAIL_LINES = 40


# --- one streamed request ----------------------------------------------------------------


@dataclass
class Sample:
    """One streamed chat completion as the client saw it (times in seconds)."""

    path: str
    prompt: int  # index into the prompt list; -1 for the warm-up
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    content_chunks: int = 0
    generation_s: float | None = None  # first to last content delta
    total_s: float | None = None
    finish_reason: str | None = None
    load1: float | None = None  # 1-minute load average when the request ended
    # CPU time other processes (not this benchmark's process tree) used during the request
    background_cpu_s: float | None = None
    background_cpu_percent: float | None = None  # ... as a share of the machine's capacity
    text: str = ""
    error: str | None = None
    job_id: str | None = None  # the completion's id ("chatcmpl-...")
    # llama-server's own time to read the prompt (its timings.prompt_ms; through the controller
    # the job's recorded time_to_first_token_ms, which is that figure): what the path left
    # llama.cpp of the machine while it read the prompt, without the hops around it
    server_prompt_ms: float | None = None


def tokens_per_second(completion_tokens: int | None, span_s: float | None) -> float | None:
    """Completion tokens over the first-to-last token time; None when undefined."""
    if not completion_tokens or span_s is None or span_s <= 0:
        return None
    return completion_tokens / span_s


class CpuMeter:
    """Busy CPU time of the whole machine and of this process tree (the benchmark, its
    clusters and llama.cpp children), to tell how much *other* work ran during a request."""

    def __init__(self) -> None:
        self.root = psutil.Process()
        self.cpus = psutil.cpu_count(logical=True) or 1

    def snapshot(self) -> tuple[float, float]:
        t = psutil.cpu_times()
        busy = t.user + t.system + sum(getattr(t, n, 0.0) for n in ("nice", "irq", "softirq"))
        ours = 0.0
        for proc in (self.root, *self.root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                ours += times.user + times.system
        return busy, ours


def background_cpu(
    before: tuple[float, float], after: tuple[float, float], wall_s: float, cpus: int
) -> tuple[float, float | None]:
    """CPU seconds used outside our process tree between two snapshots, and that as a
    percentage of the machine's capacity over ``wall_s``."""
    other = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))
    percent = 100.0 * other / (wall_s * cpus) if wall_s > 0 and cpus > 0 else None
    return other, percent


def measure(
    client: OpenAI,
    *,
    path: str,
    prompt_index: int,
    prompt: str,
    model: str,
    max_tokens: int,
    seed: int,
    meter: CpuMeter | None = None,
) -> Sample:
    """Stream one completion and time it. The same code serves every path."""
    cpu_before = meter.snapshot() if meter is not None else None
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    sample = Sample(path=path, prompt=prompt_index)
    parts: list[str] = []
    first: float | None = None
    last: float | None = None
    start = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            for chunk in stream:
                now = time.perf_counter()
                if sample.job_id is None:
                    sample.job_id = chunk.id
                timings = (chunk.model_extra or {}).get("timings")
                if isinstance(timings, dict) and timings.get("prompt_ms") is not None:
                    sample.server_prompt_ms = float(timings["prompt_ms"])
                if chunk.usage is not None:
                    sample.completion_tokens = chunk.usage.completion_tokens
                    sample.prompt_tokens = chunk.usage.prompt_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        if first is None:
                            first = now
                        last = now
                        parts.append(choice.delta.content)
                        sample.content_chunks += 1
                    if choice.finish_reason:
                        sample.finish_reason = choice.finish_reason
    except OpenAIError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.total_s = time.perf_counter() - start
    if meter is not None and cpu_before is not None:
        sample.background_cpu_s, sample.background_cpu_percent = background_cpu(
            cpu_before, meter.snapshot(), sample.total_s, meter.cpus
        )
    with contextlib.suppress(OSError, AttributeError):
        sample.load1 = round(os.getloadavg()[0], 2)
    sample.text = "".join(parts)
    if first is not None and last is not None:
        sample.ttft_s = first - start
        sample.generation_s = last - first
    if sample.error is None:
        if first is None:
            sample.error = "the stream carried no content"
        elif sample.completion_tokens is None:
            sample.error = "the stream carried no usage chunk (stream_options.include_usage)"
    sample.tokens_per_s = tokens_per_second(sample.completion_tokens, sample.generation_s)
    return sample


# --- mirroring the agents' llama.cpp settings --------------------------------------------

_START_LINE = re.compile(r"^=== \S+ starting: (?P<argv>.+)$", re.MULTILINE)


def parse_start_lines(log_text: str) -> list[list[str]]:
    """Every command line the agent's runtime logged (``=== <time> starting: <argv>``), in order."""
    commands = []
    for match in _START_LINE.finditer(log_text):
        with contextlib.suppress(ValueError):
            commands.append(shlex.split(match.group("argv")))
    return commands


@dataclass(frozen=True)
class ServerSettings:
    """The performance-relevant ``llama-server`` settings, as the agents ran them."""

    ctx_size: int = server_spec.DEFAULT_CTX_SIZE
    parallel: int = 1
    threads: int | None = None
    poll: int = server_spec.DEFAULT_POLL
    n_gpu_layers: int | None = None
    tensor_split: tuple[float, ...] = ()
    rpc_count: int = 0
    extra_args: tuple[str, ...] = ()
    source: str = "defaults"


# Flags ServerSpec.argv always writes (or derives), with the number of values each takes.
_SPEC_FLAGS = {
    "--model": 1,
    "-m": 1,
    "--host": 1,
    "--port": 1,
    "--fit": 1,
    "--log-verbosity": 1,
    "--alias": 1,
    "--no-webui": 0,
    "--kv-unified": 0,
}


def settings_from_argv(argv: Sequence[str], source: str) -> ServerSettings:
    """The :class:`ServerSettings` of a logged ``llama-server`` command line.

    Flags :class:`agent.runtime.server_spec.ServerSpec` writes itself are dropped; flags it does
    not know are kept, in order, as ``extra_args``.
    """
    values: dict[str, str] = {}
    extra: list[str] = []
    aliases = {
        "-c": "--ctx-size",
        "-np": "--parallel",
        "-t": "--threads",
        "-ngl": "--n-gpu-layers",
        "--gpu-layers": "--n-gpu-layers",
        "-ts": "--tensor-split",
    }
    wanted = {
        "--ctx-size",
        "--parallel",
        "--threads",
        "--poll",
        "--n-gpu-layers",
        "--tensor-split",
        "--rpc",
    }
    items = list(argv[1:])
    i = 0
    while i < len(items):
        flag = aliases.get(items[i], items[i])
        if flag in wanted and i + 1 < len(items):
            values[flag] = items[i + 1]
            i += 2
        elif flag in _SPEC_FLAGS:
            i += 1 + _SPEC_FLAGS[flag]
        else:
            extra.append(items[i])
            i += 1
    split = tuple(float(x) for x in values.get("--tensor-split", "").split(",") if x)
    rpc = [x for x in values.get("--rpc", "").split(",") if x]
    threads = values.get("--threads")
    layers = values.get("--n-gpu-layers")
    return ServerSettings(
        ctx_size=int(values.get("--ctx-size", server_spec.DEFAULT_CTX_SIZE)),
        parallel=int(values.get("--parallel", 1)),
        threads=int(threads) if threads is not None else None,
        poll=int(values.get("--poll", server_spec.DEFAULT_POLL)),
        n_gpu_layers=int(layers) if layers is not None else None,
        tensor_split=split,
        rpc_count=len(rpc),
        extra_args=tuple(extra),
        source=source,
    )


def rpc_threads_from_argv(argv: Sequence[str]) -> int | None:
    """``--threads`` of a logged ``ggml-rpc-server`` command line, if given."""
    for i, item in enumerate(argv[:-1]):
        if item in ("--threads", "-t"):
            return int(argv[i + 1])
    return None


def _last_command(root: Path, pattern: str, binary_prefix: str) -> tuple[list[str], Path] | None:
    found: list[tuple[float, list[str], Path]] = []
    for log in root.rglob(pattern):
        try:
            text = log.read_text(errors="replace")
            mtime = log.stat().st_mtime
        except OSError:
            continue
        commands = [c for c in parse_start_lines(text) if Path(c[0]).name.startswith(binary_prefix)]
        if commands:
            found.append((mtime, commands[-1], log))
    if not found:
        return None
    _, argv, log = max(found, key=lambda item: item[0])
    return argv, log


def mirrored_server(cluster_dir: Path) -> tuple[ServerSettings, list[str]] | None:
    """The settings (and full command) of the last ``llama-server`` an agent started."""
    found = _last_command(cluster_dir, "llama-server*.log", "llama-server")
    if found is None:
        return None
    argv, log = found
    return settings_from_argv(argv, source=str(log)), argv


def mirrored_rpc_threads(cluster_dir: Path) -> tuple[int | None, list[str]] | None:
    found = _last_command(cluster_dir, "rpc-worker*.log", "")
    if found is None:
        return None
    argv, _ = found
    return rpc_threads_from_argv(argv), argv


# --- machine -----------------------------------------------------------------------------


def cpu_model_from_cpuinfo(text: str) -> str | None:
    """The ``model name`` of the first processor in ``/proc/cpuinfo`` text."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return None


def describe_machine() -> dict[str, Any]:
    cpu_model: str | None = None
    virtualized: bool | None = None
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        cpu_model = cpu_model_from_cpuinfo(cpuinfo)
        virtualized = bool(re.search(r"^flags\s*:.*\bhypervisor\b", cpuinfo, re.MULTILINE))
    memory = psutil.virtual_memory()
    freq = None
    with contextlib.suppress(Exception):
        current = psutil.cpu_freq()
        freq = round(current.current) if current else None
    load = None
    with contextlib.suppress(OSError, AttributeError):
        load = [round(x, 2) for x in os.getloadavg()]
    return {
        "cpu_model": cpu_model or platform.processor() or platform.machine(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cpus": psutil.cpu_count(logical=True),
        "cpu_freq_mhz": freq,
        "virtualized": virtualized,
        "ram_total_bytes": memory.total,
        "ram_available_bytes": memory.available,
        "load_average_at_start": load,
        "os": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp": llama_binaries.LLAMA_DIST_VERSION,
        "model_file": paths.MODEL_FILE_NAME,
        "model_sha256": paths.MODEL_SHA256,
    }


def machine_line(machine: dict[str, Any]) -> str:
    """One line: CPU, cores, RAM, OS, versions, and how busy the machine was."""
    cores = machine.get("physical_cores")
    cpus = machine.get("logical_cpus")
    virt = ", VM" if machine.get("virtualized") else ""
    text = (
        f"{machine.get('cpu_model')} ({cores} cores / {cpus} threads{virt}), "
        f"RAM {stats.human_bytes(machine.get('ram_total_bytes'))}, {machine.get('os')}, "
        f"Python {machine.get('python')}, llama.cpp {machine.get('llama_cpp')}"
    )
    if machine.get("llama_backend"):
        text += f" ({machine['llama_backend']} backend)"
    busy = machine.get("cpu_busy_percent_before_measuring")
    if busy is not None:
        text += f", CPU {stats.fmt(busy, 0)}% busy before measuring"
    text += f", load avg {machine.get('load_average_at_start')}"
    if machine.get("load_average_at_end"):
        text += f" -> {machine['load_average_at_end']}"
    return text


# --- paths -------------------------------------------------------------------------------


@dataclass
class PathRun:
    key: str
    label: str
    client: OpenAI | None = None
    base_url: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    warmup: Sample | None = None
    samples: list[Sample] = field(default_factory=list)
    failure: str | None = None
    skipped: str | None = None  # why the path could not run on this machine (not a failure)
    diagnostics: list[str] = field(default_factory=list)
    cluster: LocalCluster | None = None
    consecutive_errors: int = 0

    @property
    def usable(self) -> bool:
        return self.client is not None and self.failure is None

    def values(self, name: str) -> dict[int, float | None]:
        return {s.prompt: getattr(s, name) for s in self.samples if s.error is None}

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.error is None]
        ttft = stats.summarize([s.ttft_s for s in ok])
        tps = stats.summarize([s.tokens_per_s for s in ok])
        tokens = stats.summarize([float(s.completion_tokens or 0) for s in ok])
        background = stats.summarize([s.background_cpu_percent for s in ok])
        return {
            "ok": len(ok),
            "errors": len(self.samples) - len(ok),
            "ttft_s": ttft.to_dict() if ttft else None,
            "tokens_per_s": tps.to_dict() if tps else None,
            "completion_tokens": tokens.to_dict() if tokens else None,
            "background_cpu_percent": background.to_dict() if background else None,
        }


def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT)


def _say(text: str) -> None:
    print(text, flush=True)


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def collect_diagnostics(run: PathRun, var_dir: Path) -> list[str]:
    """Exit codes of the cluster's processes and the tails of every log it wrote."""
    out: list[str] = []
    if run.cluster is not None:
        for proc in run.cluster.procs:
            code = proc.popen.poll()
            state = "running" if code is None else managed_child.describe_exit(code)
            out.append(f"process {proc.name} (pid {proc.popen.pid}) {state}")
    for log in sorted(var_dir.rglob("*.log")):
        out.append(f"--- {log} (last {_LOG_TAIL_LINES} lines)")
        out.extend(_tail(log))
    return out


def fail(run: PathRun, reason: str, var_dir: Path | None) -> None:
    run.failure = reason
    _say(f"!! path {run.key} failed: {reason}")
    if var_dir is not None:
        run.diagnostics = collect_diagnostics(run, var_dir)
        print("\n".join(run.diagnostics), file=sys.stderr, flush=True)


def skip(run: PathRun, reason: str) -> None:
    run.skipped = reason
    _say(f"[{run.key}] skipped: {reason}")


def start_cluster(
    stack: contextlib.ExitStack, run: PathRun, config: ClusterConfig
) -> LocalCluster | None:
    _say(f"[{run.key}] starting local cluster in {config.var_dir} ...")
    cluster = LocalCluster(config)
    run.cluster = cluster
    started = time.perf_counter()
    try:
        stack.enter_context(cluster)
    except Exception as exc:  # reported with the logs; the other paths still run
        fail(run, f"the local cluster did not start: {type(exc).__name__}: {exc}", config.var_dir)
        return None
    run.base_url = f"{cluster.url}/v1"
    run.client = _client(run.base_url, cluster.ai_api_key)
    run.details.update(
        cluster_dir=str(config.var_dir),
        agents=[asdict(a) for a in config.agents],
        startup_s=round(time.perf_counter() - started, 2),
    )
    _say(f"[{run.key}] cluster ready at {cluster.url} ({run.details['startup_s']} s)")
    return cluster


def recorded_prompt_times(run: PathRun, timeout: float = 10.0) -> None:
    """Fills each sample's ``server_prompt_ms`` from its job as the controller recorded it
    (the admin jobs API: ``timings.time_to_first_token_ms``, llama-server's prompt_ms)."""
    assert run.cluster is not None
    headers = {"Authorization": f"Bearer {run.cluster.admin_api_key}"}
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=run.cluster.url, headers=headers, timeout=10.0) as client:
        for sample in run.samples:
            if sample.error is not None or sample.job_id is None:
                continue
            job_id = str(UUID(sample.job_id.removeprefix("chatcmpl-")))  # the dashed form
            while True:  # the views may lag the job's ending by a moment
                answer = client.get(f"/api/admin/jobs/{job_id}")
                value = (
                    answer.json().get("timings", {}).get("time_to_first_token_ms")
                    if answer.status_code == 200
                    else None
                )
                if value is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            sample.server_prompt_ms = float(value) if value is not None else None


def start_direct(
    stack: contextlib.ExitStack,
    run: PathRun,
    binaries: llama_binaries.RuntimeBinaries,
    log_dir: Path,
    settings: ServerSettings,
    *,
    rpc_workers: int,
    rpc_threads: int | None,
    gated: bool = False,
    lan: emulated_lan.LinkShape | None = None,
) -> None:
    """``llama-server`` (and its RPC workers, each behind the agent's accept filter when
    ``gated``, each over an emulated LAN link shaped like ``lan`` when given) via the agent's
    runtime, stopped by ``stack``."""
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    endpoints: list[str] = []
    try:
        if lan is not None:
            network = stack.enter_context(emulated_lan.EmulatedLan(rpc_workers, lan, log_dir))
            run.details["lan"] = network.describe()
            for index in range(rpc_workers):
                endpoints.append(network.start_rpc_worker(index, binaries, threads=rpc_threads))
        else:
            endpoints = loopback_workers(stack, binaries, log_dir, rpc_workers, rpc_threads, gated)
        split = settings.tensor_split if rpc_workers else ()
        if rpc_workers and len(split) != rpc_workers:
            split = tuple(1.0 / rpc_workers for _ in range(rpc_workers))
        spec = server_spec.ServerSpec(
            model_path=str(paths.model_path()),
            ctx_size=settings.ctx_size,
            rpc_endpoints=tuple(endpoints),
            tensor_split=split,
            n_gpu_layers=settings.n_gpu_layers,
            parallel=settings.parallel,
            threads=settings.threads,
            poll=settings.poll,
            extra_args=settings.extra_args,
        )
        server = llama_server.LlamaServer(binaries, spec, log_dir=log_dir)
        stack.callback(server.stop)
        server.start()
    except emulated_lan.LanUnavailable as exc:
        skip(run, f"no emulated LAN here: {exc}")
        return
    except (runtime_errors.LlamaRuntimeError, OSError, ValueError) as exc:
        fail(run, f"{type(exc).__name__}: {exc}", log_dir)
        return
    run.base_url = f"{server.base_url}/v1"
    run.client = _client(run.base_url, "unused")
    run.details.update(
        log_dir=str(log_dir),
        settings=asdict(settings),
        argv=spec.argv(binaries.llama_server, server.host, server.port),
        rpc_workers=endpoints,
        rpc_threads=rpc_threads,
        startup_s=round(time.perf_counter() - started, 2),
    )
    _say(
        f"[{run.key}] llama-server at {server.base_url} ({run.details['startup_s']} s): "
        + shlex.join(run.details["argv"][1:])
    )


def loopback_workers(
    stack: contextlib.ExitStack,
    binaries: llama_binaries.RuntimeBinaries,
    log_dir: Path,
    count: int,
    threads: int | None,
    gated: bool,
) -> list[str]:
    """``count`` RPC workers on loopback (each behind the agent's accept filter when
    ``gated``), stopped by ``stack``; their endpoints."""
    endpoints = []
    for _ in range(count):
        port = free_loopback_port()
        gate = None
        if gated:
            if binaries.accept_filter is None:
                raise runtime_errors.RuntimeMissingError(
                    "the RPC accept filter is not built: run python -m ops.build_llama"
                )
            gate = PeerFilter(
                LOOPBACK, port, binaries.accept_filter, log_dir / f"peers-{port}", (LOOPBACK,)
            )
            gate.admit_only([("", LOOPBACK)])
        worker = rpc_worker.RpcWorker(
            binaries, LOOPBACK, port, log_dir=log_dir, threads=threads, accept_filter=gate
        )
        stack.callback(worker.stop)
        worker.start()
        endpoints.append(worker.endpoint)
    return endpoints


def warm_up(run: PathRun, args: argparse.Namespace, var_dir: Path) -> None:
    if not run.usable:
        return
    assert run.client is not None
    sample = measure(
        run.client,
        path=run.key,
        prompt_index=-1,
        prompt="Say hello.",
        model=MODEL_NAME,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    run.warmup = sample
    if sample.error is not None:
        fail(run, f"warm-up request: {sample.error}", var_dir)
        return
    _say(
        f"[{run.key}] warm-up: first token after {stats.fmt(sample.ttft_s, 0, scale=1000)} ms, "
        f"{stats.fmt(sample.tokens_per_s)} tok/s"
    )


def wait_until_idle(timeout: float, threshold: float, interval: float = 2.0) -> float:
    """Wait (at most ``timeout`` s) until system-wide CPU use over ``interval`` s is below
    ``threshold`` percent; returns the last reading. Our idle servers use next to nothing."""
    deadline = time.monotonic() + timeout
    waited = False
    while True:
        busy = psutil.cpu_percent(interval=interval)
        if busy < threshold or time.monotonic() >= deadline:
            if waited:
                _say(f"CPU {busy:.0f}% busy: going on")
            return busy
        if not waited:
            _say(f"waiting for an idle machine: CPU {busy:.0f}% busy (threshold {threshold:.0f}%)")
        waited = True


def interleaved_order(keys: Sequence[str], prompt_index: int) -> list[str]:
    """The paths in order for one prompt: forward on even prompts, reversed on odd ones."""
    return list(keys) if prompt_index % 2 == 0 else list(reversed(keys))


# --- results -----------------------------------------------------------------------------


def quiet_prompts(runs: Sequence[PathRun], max_background: float) -> set[int]:
    """Prompts on which every run's request succeeded with at most ``max_background`` percent
    of the machine busy with other processes."""
    quiet: set[int] | None = None
    for run in runs:
        mine = {
            s.prompt
            for s in run.samples
            if s.error is None
            and s.background_cpu_percent is not None
            and s.background_cpu_percent <= max_background
        }
        quiet = mine if quiet is None else quiet & mine
    return quiet or set()


def compare(num: PathRun, den: PathRun, *, max_background: float | None = None) -> dict[str, Any]:
    """Ratios ``num / den`` over the prompts both answered (only the quiet ones when
    ``max_background`` is given): ratio of the medians, median of the per-prompt ratios, and
    the median per-prompt TTFT difference."""
    prompts = {s.prompt for s in num.samples if s.error is None} & {
        s.prompt for s in den.samples if s.error is None
    }
    if max_background is not None:
        prompts &= quiet_prompts([num, den], max_background)

    def values(run: PathRun, name: str) -> dict[int, float | None]:
        return {k: v for k, v in run.values(name).items() if k in prompts}

    def median(run: PathRun, name: str) -> float | None:
        summary = stats.summarize(list(values(run, name).values()))
        return summary.median if summary else None

    ttft_pairs = stats.paired(values(num, "ttft_s"), values(den, "ttft_s"))
    tps_pairs = stats.paired(values(num, "tokens_per_s"), values(den, "tokens_per_s"))
    texts_num = {s.prompt: s.text for s in num.samples if s.prompt in prompts}
    texts_den = {s.prompt: s.text for s in den.samples if s.prompt in prompts}
    common = sorted(texts_num.keys() & texts_den.keys())
    overhead = stats.paired_difference_median(ttft_pairs)
    prompt_pairs = stats.paired(values(num, "server_prompt_ms"), values(den, "server_prompt_ms"))
    return {
        "numerator": num.key,
        "denominator": den.key,
        "max_background_cpu_percent": max_background,
        "ttft_ratio_of_medians": stats.ratio(median(num, "ttft_s"), median(den, "ttft_s")),
        "ttft_ratio_paired_median": stats.paired_ratio_median(ttft_pairs),
        "ttft_overhead_ms_paired_median": overhead * 1000 if overhead is not None else None,
        # How much longer llama-server itself took to read the prompt (ms, paired median): the
        # part of the added TTFT that is CPU taken from llama.cpp, not hops.
        "server_prompt_ms_paired_difference": stats.paired_difference_median(prompt_pairs),
        "tokens_per_s_ratio_of_medians": stats.ratio(
            median(num, "tokens_per_s"), median(den, "tokens_per_s")
        ),
        "tokens_per_s_ratio_paired_median": stats.paired_ratio_median(tps_pairs),
        "pairs": len(ttft_pairs),
        "identical_text": sum(texts_num[i] == texts_den[i] for i in common),
        "compared_texts": len(common),
    }


def results_table(runs: Sequence[PathRun]) -> str:
    rows = []
    for run in runs:
        s = run.summary()
        ttft, tps, tokens = s["ttft_s"], s["tokens_per_s"], s["completion_tokens"]
        background = s["background_cpu_percent"]
        warm = run.warmup.ttft_s if run.warmup else None
        rows.append(
            [
                run.key,
                run_label(run),
                f"{s['ok']}/{len(run.samples)}",
                stats.fmt(ttft["median"] if ttft else None, 1, scale=1000),
                stats.fmt(ttft["p90"] if ttft else None, 1, scale=1000),
                stats.fmt(tps["median"] if tps else None, 1),
                stats.fmt(tps["p90"] if tps else None, 1),
                stats.fmt(tokens["mean"] if tokens else None, 1),
                stats.fmt(warm, 0, scale=1000),
                stats.fmt(background["median"] if background else None, 0),
            ]
        )
    headers = [
        "path",
        "what",
        "ok",
        "TTFT med ms",
        "TTFT p90 ms",
        "tok/s med",
        "tok/s p90",
        "tokens",
        "warm-up TTFT ms",
        "bg CPU % med",
    ]
    return stats.format_table(headers, rows, align="llrrrrrrrr")


def run_label(run: PathRun) -> str:
    if run.skipped is not None:
        return f"{run.label} [skipped]"
    return run.label if run.failure is None else f"{run.label} [FAILED]"


def ratios_table(comparisons: Sequence[dict[str, Any]]) -> str:
    rows = []
    for c in comparisons:
        rows.append(
            [
                f"{c['numerator']}/{c['denominator']}",
                c["meaning"],
                stats.fmt_ratio(c["ttft_ratio_of_medians"]),
                stats.fmt_ratio(c["ttft_ratio_paired_median"]),
                stats.fmt(c["ttft_overhead_ms_paired_median"], 1),
                stats.fmt(c.get("server_prompt_ms_paired_difference"), 2),
                stats.fmt_ratio(c["tokens_per_s_ratio_of_medians"]),
                stats.fmt_ratio(c["tokens_per_s_ratio_paired_median"]),
                f"{c['identical_text']}/{c['compared_texts']}",
                str(c["pairs"]),
            ]
        )
    headers = [
        "ratio",
        "meaning",
        "TTFT (medians)",
        "TTFT (paired)",
        "TTFT +ms (paired)",
        "of it prompt +ms",
        "tok/s (medians)",
        "tok/s (paired)",
        "same text",
        "pairs",
    ]
    return stats.format_table(headers, rows, align="llrrrrrrrr")


def default_output(now: dt.datetime) -> Path:
    return Path("var/bench") / f"compare_paths-{now.strftime('%Y-%m-%dT%H%M%S')}.json"


# --- main --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare_paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--prompts", type=int, default=None, help=f"prompts per path ({DEFAULT_PROMPTS})"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (64)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--quick", action="store_true", help="3 prompts x 16 tokens")
    parser.add_argument(
        "--paths",
        default=",".join(PATH_ORDER),
        help="comma-separated subset of a,b1,c,cg,cl,b2 (default all)",
    )
    parser.add_argument(
        "--lan-rate",
        default=emulated_lan.LinkShape.rate,
        help="tbf rate of path cl's emulated links (default %(default)s)",
    )
    parser.add_argument(
        "--lan-rtt-ms",
        type=float,
        default=emulated_lan.LinkShape.rtt_ms,
        help="round trip path cl's delay proxies add (default %(default)s; 0: no proxies)",
    )
    parser.add_argument(
        "--split",
        default="0.5,0.5",
        help="--tensor-split for path c when b2 does not run or its command is not found",
    )
    parser.add_argument(
        "--solo-memory-limit",
        type=int,
        default=SOLO_MEMORY_LIMIT,
        help="bytes the single b1 agent offers (default 4 GiB: the model fits on one node)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before measuring, wait up to this long for the CPU to go idle (default: don't)",
    )
    parser.add_argument(
        "--idle-threshold",
        type=float,
        default=20.0,
        metavar="PERCENT",
        help="system-wide CPU use below which --wait-idle counts the machine as idle",
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=10.0,
        metavar="PERCENT",
        help="also compare over the prompts where both paths saw at most this much "
        "background CPU (default 10)",
    )
    parser.add_argument("--var-dir", type=Path, default=Path("var/bench/run"))
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (3 if args.quick else DEFAULT_PROMPTS)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    keys = [k.strip() for k in args.paths.split(",") if k.strip()]
    unknown = set(keys) - set(PATH_ORDER)
    if unknown or not keys:
        parser.error(f"--paths takes a subset of {','.join(PATH_ORDER)}, got {args.paths!r}")
    args.path_keys = [k for k in PATH_ORDER if k in keys]
    try:
        args.split_values = tuple(float(x) for x in args.split.split(","))
    except ValueError:
        parser.error(f"--split takes comma-separated numbers, got {args.split!r}")
    if args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompts and --max-tokens must be positive")
    if args.lan_rtt_ms < 0:
        parser.error("--lan-rtt-ms must not be negative")
    args.lan_shape = emulated_lan.LinkShape(rate=args.lan_rate, rtt_ms=args.lan_rtt_ms)
    return args


def ran(runs: dict[str, PathRun], *keys: str) -> bool:
    """Whether every one of ``keys`` was asked for and not skipped (a failed path still is)."""
    return all(key in runs and runs[key].skipped is None for key in keys)


def prompt_list(count: int) -> list[str]:
    """``count`` prompts, cycling through the fixed list (with a numbered suffix on repeats)."""
    out = []
    for i in range(count):
        base = PROMPTS[i % len(PROMPTS)]
        rnd = i // len(PROMPTS)
        out.append(base if rnd == 0 else f"{base} (variant {rnd + 1})")
    return out


def run_benchmark(args: argparse.Namespace) -> tuple[dict[str, Any], list[PathRun]]:
    started_at = dt.datetime.now().astimezone()
    machine = describe_machine()
    _say(f"machine: {machine_line(machine)}")
    _say(
        f"settings: {args.prompts} prompts x max_tokens {args.max_tokens}, temperature 0, "
        f"seed {args.seed}, paths {','.join(args.path_keys)}"
    )
    backend = choose_backend(None)  # as the agents choose theirs: $LLAMA_BACKEND, else auto
    artifacts.ensure_llama(backend.backend)
    artifacts.ensure_model()
    binaries = llama_binaries.find_binaries(None, backend.backend)
    machine["llama_backend"] = binaries.backend
    why = f" ({backend.why})" if binaries.backend == backend.backend else ""
    _say(f"llama.cpp backend: {binaries.backend}{why}, {binaries.bin_dir}")
    var_dir: Path = args.var_dir
    runs = {key: PathRun(key, LABELS[key]) for key in args.path_keys}
    prompts = prompt_list(args.prompts)

    with contextlib.ExitStack() as stack:
        # 1. the clusters, then one warm-up each (that is when the agents start llama.cpp)
        if "b1" in runs:
            start_cluster(
                stack,
                runs["b1"],
                ClusterConfig(
                    var_dir=var_dir / "b1-cluster",
                    port=8100,
                    grpc_port=50151,
                    agents=(
                        AgentSpec(
                            "solo", 50172, memory_limit=args.solo_memory_limit, holds_model=True
                        ),
                    ),
                    quiet=True,
                ),
            )
        if "b2" in runs:
            start_cluster(
                stack,
                runs["b2"],
                ClusterConfig(
                    var_dir=var_dir / "b2-cluster",
                    port=8200,
                    grpc_port=50251,
                    agents=(
                        AgentSpec("agent-a", 50282, DEFAULT_MEMORY_LIMIT, holds_model=True),
                        AgentSpec("agent-b", 50292, DEFAULT_MEMORY_LIMIT),
                    ),
                    quiet=True,
                ),
            )
        for key in ("b1", "b2"):
            if key in runs:
                warm_up(runs[key], args, var_dir / f"{key}-cluster")

        # 2. the direct servers, mirroring what the agents ran
        solo = ServerSettings()
        split = ServerSettings(
            n_gpu_layers=None,
            tensor_split=args.split_values,
            rpc_count=len(args.split_values),
            source="--split",
        )
        rpc_threads: int | None = None
        if "b1" in runs and runs["b1"].usable:
            found = mirrored_server(var_dir / "b1-cluster")
            if found is not None:
                solo = found[0]
                runs["b1"].details["agent_llama_server_argv"] = found[1]
        if "b2" in runs and runs["b2"].usable:
            found = mirrored_server(var_dir / "b2-cluster")
            if found is not None:
                split = found[0]
                runs["b2"].details["agent_llama_server_argv"] = found[1]
            workers = mirrored_rpc_threads(var_dir / "b2-cluster")
            if workers is not None:
                rpc_threads = workers[0]
                runs["b2"].details["agent_rpc_worker_argv"] = workers[1]
        if "a" in runs:
            start_direct(
                stack,
                runs["a"],
                binaries,
                var_dir / "a-direct",
                replace(solo, tensor_split=(), rpc_count=0),
                rpc_workers=0,
                rpc_threads=None,
            )
            warm_up(runs["a"], args, var_dir / "a-direct")
        for key in ("c", "cg", "cl"):
            if key not in runs:
                continue
            start_direct(
                stack,
                runs[key],
                binaries,
                var_dir / f"{key}-direct",
                split,
                rpc_workers=split.rpc_count or len(args.split_values),
                rpc_threads=rpc_threads,
                gated=key == "cg",
                lan=args.lan_shape if key == "cl" else None,
            )
            warm_up(runs[key], args, var_dir / f"{key}-direct")

        # 3. the measured requests, interleaved
        idle_budget_end = time.monotonic() + args.wait_idle
        if args.wait_idle > 0:
            wait_until_idle(args.wait_idle, args.idle_threshold)
        machine["cpu_busy_percent_before_measuring"] = psutil.cpu_percent(interval=1.0)
        meter = CpuMeter()
        active = [k for k in PATH_ORDER if k in runs and runs[k].usable]
        _say(f"measuring {len(prompts)} prompts over {','.join(active) or 'no paths'}")
        for index, prompt in enumerate(prompts):
            remaining = idle_budget_end - time.monotonic()
            if args.wait_idle > 0 and remaining > 0:
                wait_until_idle(remaining, args.idle_threshold, interval=1.0)
            cells = []
            for key in interleaved_order(active, index):
                run = runs[key]
                if not run.usable:
                    continue
                assert run.client is not None
                sample = measure(
                    run.client,
                    path=key,
                    prompt_index=index,
                    prompt=prompt,
                    model=MODEL_NAME,
                    max_tokens=args.max_tokens,
                    seed=args.seed,
                    meter=meter,
                )
                run.samples.append(sample)
                if sample.error is None:
                    run.consecutive_errors = 0
                    cells.append(
                        f"{key} {stats.fmt(sample.ttft_s, 0, scale=1000)} ms "
                        f"{stats.fmt(sample.tokens_per_s)} tok/s "
                        f"(bg {stats.fmt(sample.background_cpu_percent, 0)}%)"
                    )
                else:
                    run.consecutive_errors += 1
                    cells.append(f"{key} ERROR")
                    _say(f"!! {key} prompt {index}: {sample.error}")
                    if run.consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
                        kind = "cluster" if key in CONTROLLER_PATHS else "direct"
                        where = var_dir / f"{key}-{kind}"
                        fail(run, f"{run.consecutive_errors} requests failed in a row", where)
            _say(f"prompt {index + 1}/{len(prompts)}: " + " | ".join(cells))

        # llama-server's prompt times of the jobs that went through a controller
        for run in runs.values():
            if run.cluster is not None and run.failure is None:
                recorded_prompt_times(run)

        # the final state of the processes, before the stack stops them
        for run in runs.values():
            if run.cluster is not None and run.failure is None:
                dead = [p.name for p in run.cluster.procs if p.popen.poll() is not None]
                if dead:
                    run.details["exited_during_run"] = dead

    with contextlib.suppress(OSError, AttributeError):
        machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    ordered = [runs[k] for k in PATH_ORDER if k in runs]
    compared = [(num, den, meaning) for num, den, meaning in COMPARISONS if ran(runs, num, den)]
    comparisons = [
        {**compare(runs[num], runs[den]), "meaning": meaning} for num, den, meaning in compared
    ]
    quiet_comparisons = [
        {**compare(runs[num], runs[den], max_background=args.quiet), "meaning": meaning}
        for num, den, meaning in compared
    ]
    result = {
        "benchmark": "compare_paths",
        "version": 1,
        "command": shlex.join(["python", "-m", "bench.compare_paths", *sys.argv[1:]]),
        "started_at": started_at.isoformat(timespec="seconds"),
        "finished_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine,
        "settings": {
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "seed": args.seed,
            "paths": args.path_keys,
            "quiet": args.quiet,
            "order": "round-robin per prompt, reversed on odd prompts",
            "ttft": "client side: request sent -> first non-empty content delta",
            "tokens_per_s": "usage.completion_tokens / (last - first content delta)",
            "background_cpu_percent": "CPU used outside this benchmark's process tree during "
            "the request, as a share of all logical CPUs",
            "prompt_texts": prompts,
        },
        "paths": {
            run.key: {
                "label": run.label,
                "base_url": run.base_url,
                "failure": run.failure,
                "skipped": run.skipped,
                "details": run.details,
                "summary": run.summary(),
                "warmup": asdict(run.warmup) if run.warmup else None,
                "samples": [asdict(s) for s in run.samples],
                "diagnostics": run.diagnostics,
            }
            for run in ordered
        },
        "comparisons": comparisons,
        "quiet_comparisons": quiet_comparisons,
    }
    return result, ordered


def report(result: dict[str, Any], runs: Sequence[PathRun]) -> str:
    settings = result["settings"]
    lines = [
        "",
        f"machine: {machine_line(result['machine'])}",
        f"{settings['prompts']} prompts x max_tokens {settings['max_tokens']}, temperature 0, "
        f"seed {settings['seed']}; interleaved {settings['order']}",
        "control channel: gRPC over TLS (the local cluster's own CA, pinned by each agent); "
        "API: plain HTTP on loopback",
        "",
        results_table(runs),
    ]
    for run in runs:
        if "lan" in run.details:
            workers = ", ".join(link["worker"] for link in run.details["lan"]["links"])
            lines.append(f"{run.key}: RPC workers at {workers}, {run.details['lan']['shape']}")
    if result["comparisons"]:
        lines += [
            "",
            "ratios (numerator / denominator; TTFT > 1x and tok/s < 1x mean the numerator is "
            "slower; 'paired' = median over prompts of the per-prompt ratio; 'bg CPU' = CPU "
            "other processes used during a request, % of the machine):",
            ratios_table(result["comparisons"]),
            "",
            f"the same, only over prompts where both paths saw <= {settings['quiet']:g}% "
            "background CPU:",
            ratios_table(result["quiet_comparisons"]),
        ]
    for run in runs:
        if run.skipped:
            lines.append(f"\npath {run.key} skipped: {run.skipped}")
        elif run.failure:
            lines.append(f"\npath {run.key} FAILED: {run.failure}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result, runs = run_benchmark(args)
    print(report(result, runs), flush=True)
    output: Path = args.output or default_output(dt.datetime.now())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(stats.json_safe(result), indent=2) + "\n")
    print(f"\nresults: {output}", flush=True)
    ok = all(
        r.skipped is not None or (r.failure is None and any(s.error is None for s in r.samples))
        for r in runs
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
