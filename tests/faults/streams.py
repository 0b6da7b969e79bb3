"""What the fault scenarios share: a streamed completion as a client sees it, a job's
recorded token sequence numbers, an agent handler that streams words slowly (no
llama.cpp), and a fake agent serving model ``m`` asked for one completion."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import orjson

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession
from agent.control.control_handler import ControlHandler, NullHandler, Send
from domain.catalog import code_of
from interfaces.controller_main import RunningController
from tests.faults.waiting import until
from tests.integration.fake_agent import FakeAgent, register_model_m
from wire import control_pb2 as pb

AI = {"Authorization": "Bearer test-ai-key"}


async def stream_completion(base_url: str, timeout: float = 60) -> dict[str, Any]:
    """One streamed completion: its job id, text, finish reason, and error (if the stream
    ended in one)."""
    out: dict[str, Any] = {
        "text": "",
        "error": None,
        "job_id": None,
        "status": None,
        "finish_reason": None,
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=timeout) as client,
        client.stream("POST", "/v1/chat/completions", headers=AI, json=body) as r,
    ):
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = orjson.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            out["job_id"] = str(UUID(chunk["id"].removeprefix("chatcmpl-")))
            for choice in chunk.get("choices", []):
                out["text"] += choice["delta"].get("content") or ""
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    return out


def events(ctl: RunningController, ident: str) -> list[Any]:
    return list(ctl.services.app.repository.event_store.get(UUID(ident)))


def node_state(ctl: RunningController, agent: FakeAgent) -> str:
    """The state the controller holds for ``agent``'s node (READY, DEGRADED, OFFLINE, ...)."""
    return str(ctl.services.app.get_node(agent.node_id).state)


def node_codes(ctl: RunningController, agent: FakeAgent) -> list[str]:
    """The codes of the events recorded for ``agent``'s node, oldest first."""
    return [code_of(e) for e in events(ctl, agent.node_id)]


def recorded_seqs(ctl: RunningController, job_id: str) -> list[int]:
    """The sequence numbers of the job's recorded token deltas, in store order."""
    return [
        int(d["seq"])
        for e in events(ctl, job_id)
        if code_of(e) == "TOKEN_STREAM_CHUNK"
        for d in e.deltas
    ]


class SlowWords(NullHandler):
    """Runs a plan by streaming ``words`` words ``delay`` seconds apart, then a result."""

    def __init__(self, words: int = 200, delay: float = 0.05) -> None:
        self.words, self.delay = words, delay
        self.jobs: list[str] = []
        self.running: set[str] = set()
        self.sent = 0  # words sent by every job so far

    def text(self) -> str:
        return "".join(f" w{i}" for i in range(self.words))

    async def on_plan(self, plan: pb.ExecutionPlan, send: Send) -> None:
        self.jobs.append(plan.job_id)
        self.running.add(plan.job_id)
        ok = pb.SetupResult(job_id=plan.job_id, ok=True, role="primary")
        await send(pb.AgentMessage(setup_result=ok))
        try:
            for seq in range(self.words):
                await asyncio.sleep(self.delay)
                delta = pb.Delta(seq=seq, text=f" w{seq}", tokens=1)
                chunk = pb.TokenChunk(job_id=plan.job_id, deltas=[delta])
                await send(pb.AgentMessage(token_chunk=chunk))
                self.sent += 1
            result = pb.JobResult(
                job_id=plan.job_id, ok=True, finish_reason="stop", completion_tokens=self.words
            )
            await send(pb.AgentMessage(job_result=result))
        finally:
            self.running.discard(plan.job_id)

    def active_job_ids(self) -> list[str]:
        return sorted(self.running)


def agent_holding_model(
    ctl: RunningController,
    tmp_path: Path,
    handler: ControlHandler,
    *,
    name: str,
    controller_url: str | None = None,
    **config: Any,
) -> AgentSession:
    """A real agent session (``handler`` instead of llama.cpp) enrolling with a fresh token,
    holding a tiny GGUF registered as model ``m``, reaching the controller at
    ``controller_url`` (its gRPC port by default; a fault proxy, say)."""
    from tests.unit.test_agent_model_store import write_tiny_gguf

    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    write_tiny_gguf(models / "m.gguf")
    sha = hashlib.sha256((models / "m.gguf").read_bytes()).hexdigest()
    ctl.services.app.register_model("m", sha, "m.gguf", 2048)
    token = ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token
    settings: dict[str, Any] = {
        "heartbeat_interval": 0.2,
        "backoff_initial": 0.05,
        "backoff_max": 0.5,
        **config,
    }
    agent_config = AgentConfig(
        data_dir=tmp_path / "agent",
        models_dir=models,
        node_name=name,
        controller_url=controller_url or f"127.0.0.1:{ctl.grpc_port}",
        enrollment_token=token,
        **settings,
    )
    return AgentSession(agent_config, handler)


def serves_model(ctl: RunningController) -> bool:
    """Whether a node can take a job for model ``m``: eligible, with the file reported (the
    report lands a moment after the node is READY)."""
    return any(row["local_models"] for row in ctl.services.read_model.eligibility())


async def serving_model_m(ctl: RunningController, agent: FakeAgent) -> None:
    """Once ``agent`` is READY, registers the model it holds as ``m`` and waits until it can
    take jobs for it."""
    await until(lambda: ctl.services.app.get_node(agent.node_id).state == "READY")
    async with http_client(ctl) as client:
        await register_model_m(client, agent.holds)
    await until(lambda: serves_model(ctl))


def http_client(ctl: RunningController, timeout: float = 30) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=timeout)


async def ask(ctl: RunningController, timeout: float = 30) -> httpx.Response:
    """One chat completion for ``m`` (not streamed), however it is answered."""
    async with http_client(ctl, timeout) as client:
        return await client.post(
            "/v1/chat/completions",
            headers=AI,
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
