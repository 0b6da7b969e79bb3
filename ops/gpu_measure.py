"""Measuring streamed chat completions for the GPU check (:mod:`ops.gpu_check`): one request's
time to first token and decode speed read from its SSE stream as it arrives (httpx, no OpenAI
SDK: it would not fit in what a device command carries), the runs those samples belong to,
and each controller run compared with the direct llama-server on the same device.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import stats

if TYPE_CHECKING:
    import httpx

#: Every request asks for this seed (temperature 0 as well): the runs decode the same tokens.
SEED = 42

#: Issue 22's performance goal, judged on a GPU backend.
MIN_DECODE_RATIO = 0.97
MAX_ADDED_TTFT_MS = 5.0
LABELS = {
    "direct": "direct llama-server",
    "one-agent": "controller -> 1 agent",
    "direct-rpc": "direct llama-server --rpc",
    "two-agents": "controller -> 2 agents",
}
#: (controller run, its direct run): the same llama.cpp command line on the same device.
PAIRS = (("one-agent", "direct"), ("two-agents", "direct-rpc"))


@dataclass(frozen=True)
class PlanView:
    """What a job's plan (``GET /api/admin/jobs``) says about where the model ran."""

    tier: str
    nodes: int
    devices: tuple[str, ...]
    parallel: int

    @classmethod
    def from_plan(cls, plan: Mapping[str, Any]) -> PlanView:
        devices = tuple(
            f"{d.get('device')}{' via RPC' if d.get('via_rpc') else ''}"
            for d in plan.get("devices") or []
        )
        return cls(
            tier=str(plan.get("tier") or ""),
            nodes=1 + len(plan.get("workers") or []),
            devices=devices,
            parallel=int(plan.get("parallel") or 1),
        )

    def line(self) -> str:
        where = ", ".join(self.devices) or "host memory"
        return f"tier {self.tier or '-'}, {self.nodes} node(s), {where}, {self.parallel} slot(s)"


# --- one streamed request ---------------------------------------------------------------


@dataclass
class Sample:
    run: str
    index: int  # -1 for the warm-up
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    completion_tokens: int | None = None
    content_chunks: int = 0
    total_s: float | None = None
    text: str = ""
    error: str | None = None


class StreamReader:
    """Reads one streamed chat completion's SSE lines as they arrive, with their times."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.completion_tokens: int | None = None
        self.chunks = 0
        self.parts: list[str] = []
        self.error: str | None = None

    def line(self, text: str, now: float) -> bool:
        """Take one line; False once the stream says it is done."""
        if not text.startswith("data:"):
            return True
        data = text[5:].strip()
        if data == "[DONE]":
            return False
        try:
            chunk = json.loads(data)
        except ValueError:
            self.error = f"not JSON in the stream: {data[:80]}"
            return False
        if not isinstance(chunk, dict):
            return True
        if chunk.get("error"):
            self.error = f"error in the stream: {str(chunk['error'])[:200]}"
            return False
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.completion_tokens = int(usage["completion_tokens"])
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.first = now if self.first is None else self.first
                self.last = now
                self.chunks += 1
                self.parts.append(content)
        return True

    def sample(self, run: str, index: int, ended: float) -> Sample:
        result = Sample(run, index, total_s=ended - self.started, text="".join(self.parts))
        result.completion_tokens = self.completion_tokens
        result.content_chunks = self.chunks
        result.error = self.error
        if self.first is not None and self.last is not None:
            result.ttft_s = self.first - self.started
            span = self.last - self.first
            if self.completion_tokens and span > 0:
                result.tokens_per_s = self.completion_tokens / span
        if result.error is None:
            if self.first is None:
                result.error = "the stream carried no content"
            elif self.completion_tokens is None:
                result.error = "the stream carried no usage (stream_options.include_usage)"
        return result


def request_body(prompt: str, model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_chat(
    client: httpx.Client, run: Run, index: int, prompt: str, model: str, max_tokens: int
) -> Sample:
    """One streamed chat completion through ``run``'s OpenAI API, timed."""
    import httpx

    headers = {"Authorization": f"Bearer {run.api_key}"}
    body = request_body(prompt, model, max_tokens)
    reader = StreamReader(time.perf_counter())
    try:
        url = f"{run.base_url}/v1/chat/completions"
        with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = response.read().decode(errors="replace")[:200]
                reader.error = f"HTTP {response.status_code}: {detail}"
            else:
                for line in response.iter_lines():
                    if not reader.line(line, time.perf_counter()):
                        break
    except httpx.HTTPError as exc:
        reader.error = f"{type(exc).__name__}: {exc}"
    return reader.sample(run.key, index, time.perf_counter())


# --- runs -------------------------------------------------------------------------------


@dataclass
class Run:
    key: str
    base_url: str = ""
    api_key: str = "unused"
    log_dir: Path | None = None
    plan: PlanView | None = None
    plan_problem: str | None = None
    argv: list[str] = field(default_factory=list)
    warmup: Sample | None = None
    samples: list[Sample] = field(default_factory=list)
    #: Why it could not be started or warmed up (it is then not measured).
    failure: str | None = None

    @property
    def label(self) -> str:
        return LABELS[self.key]

    @property
    def usable(self) -> bool:
        return self.failure is None and self.warmup is not None and self.warmup.error is None

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    def median(self, name: str) -> float | None:
        summary = stats.summarize([getattr(s, name) for s in self.ok()])
        return summary.median if summary else None

    def by_index(self, name: str) -> dict[int, float | None]:
        return {s.index: getattr(s, name) for s in self.ok()}


@dataclass(frozen=True)
class Comparison:
    """A controller run beside its direct run."""

    controller: str
    direct: str
    decode_ratio: float | None
    added_ttft_ms: float | None
    pairs: int

    @classmethod
    def of(cls, controller: Run, direct: Run) -> Comparison:
        ttft = stats.paired(controller.by_index("ttft_s"), direct.by_index("ttft_s"))
        added = stats.paired_difference_median(ttft)
        return cls(
            controller.key,
            direct.key,
            stats.ratio(controller.median("tokens_per_s"), direct.median("tokens_per_s")),
            added * 1000 if added is not None else None,
            len(ttft),
        )

    def verdicts(self) -> list[tuple[str, bool]]:
        """Each goal of issue 22 with whether this comparison meets it."""
        ratio, added = self.decode_ratio, self.added_ttft_ms
        return [
            (
                f"{self.controller}: decode {stats.fmt_ratio(ratio)} of direct "
                f"(>= {MIN_DECODE_RATIO:.2f}x)",
                ratio is not None and ratio >= MIN_DECODE_RATIO,
            ),
            (
                f"{self.controller}: added TTFT {stats.fmt(added, 2)} ms "
                f"(<= {MAX_ADDED_TTFT_MS:g} ms)",
                added is not None and added <= MAX_ADDED_TTFT_MS,
            ),
        ]


def results_table(runs: Sequence[Run], comparisons: Sequence[Comparison]) -> str:
    against = {c.controller: c for c in comparisons}
    mirrors = {direct: controller for controller, direct in PAIRS}
    rows = []
    for run in runs:
        comparison = against.get(run.key)
        tokens = stats.summarize([float(s.completion_tokens or 0) for s in run.ok()])
        plan = run.plan.line() if run.plan else "-"
        if run.key in mirrors:
            plan = f"replays the {mirrors[run.key]} run's llama-server"
        rows.append(
            [
                run.key,
                run.label if run.failure is None else f"{run.label} [NOT MEASURED]",
                plan,
                f"{len(run.ok())}/{len(run.samples)}",
                stats.fmt(tokens.mean if tokens else None, 0),
                stats.fmt(run.median("tokens_per_s"), 1),
                stats.fmt(run.median("ttft_s"), 1, scale=1000),
                stats.fmt_ratio(comparison.decode_ratio) if comparison else "1 (base)",
                stats.fmt(comparison.added_ttft_ms, 2) if comparison else "0 (base)",
            ]
        )
    headers = [
        "run",
        "what",
        "plan",
        "ok",
        "tokens",
        "decode tok/s",
        "TTFT ms",
        "decode vs direct",
        "TTFT +ms vs direct",
    ]
    return stats.format_table(headers, rows, align="lllrrrrrr")
