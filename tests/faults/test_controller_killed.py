"""The controller SIGKILLed mid-stream and started again: agents reconnect without enrolling
again, the job that was running ends as JOB_FAILED with a reason that says so, the node that
ran it is READY again, and a drain requested before the crash survives it.

The controller runs as its own process (``dacp controller``) on the shared PostgreSQL (own
schema) and Redis (own key prefix); two real agent sessions (``AgentSession``; a handler that
streams words slowly instead of llama.cpp) connect to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession, AgentState
from application.controller import Controller
from domain.catalog import code_of
from infrastructure.persistence import persistence_env
from interfaces.controller_main import LEASE_TTL, RECONCILE_INTERVAL
from tests.conftest import TEST_DATABASE_URL, TEST_REDIS_URL
from tests.faults.services import free_port
from tests.faults.streams import SlowWords
from tests.faults.waiting import until
from tests.unit.test_agent_model_store import write_tiny_gguf

ADMIN = {"Authorization": "Bearer test-admin-key"}
AI = {"Authorization": "Bearer test-ai-key"}
REPO = Path(__file__).resolve().parents[2]


class ControllerProcess:
    def __init__(self, schema: str, var_dir: Path) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.env = {
            **os.environ,
            "DATABASE_URL": f"{TEST_DATABASE_URL}?schema={schema}",
            "REDIS_URL": TEST_REDIS_URL,
            "REDIS_KEY_PREFIX": f"dacp-test:{schema}:",
            "PORT": str(self.http_port),
            "GRPC_PORT": str(self.grpc_port),
            "AI_API_KEY": "test-ai-key",
            "ADMIN_API_KEY": "test-admin-key",
            "NODE_ENROLLMENT_SECRET": "test-enrollment-secret",
            "HEARTBEAT_INTERVAL": "0.2",
            "DEGRADED_AFTER": "1",
            "OFFLINE_AFTER": "2",
            "DACP_VAR_DIR": str(var_dir),
        }
        self.log = var_dir / "controller.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "interfaces.cli.main", "controller"],
                env=self.env,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def ctl(pg_schema: str, tmp_path: Path) -> Iterator[ControllerProcess]:
    process = ControllerProcess(pg_schema, tmp_path / "var")
    process.start()
    yield process
    process.stop()


def _up(ctl: ControllerProcess) -> bool:
    return httpx.get(ctl.url("/health"), timeout=1).status_code == 200


@pytest.fixture
async def agents(ctl: ControllerProcess, tmp_path: Path) -> AsyncIterator[list[AgentSession]]:
    await until(lambda: _up(ctl), 60)
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "m.gguf")
    sha = hashlib.sha256((models / "m.gguf").read_bytes()).hexdigest()
    async with httpx.AsyncClient() as client:
        r = await client.post(
            ctl.url("/api/admin/models"),
            headers=ADMIN,
            json={"name": "m", "sha256": sha, "file_name": "m.gguf"},
        )
        assert r.status_code == 201, r.text
        sessions = []
        for name in ("runs", "drained"):
            minted = await client.post(ctl.url("/api/admin/enrollment-tokens"), headers=ADMIN)
            config = AgentConfig(
                data_dir=tmp_path / name,
                models_dir=models,
                node_name=name,
                controller_url=f"127.0.0.1:{ctl.grpc_port}",
                enrollment_token=minted.json()["token"],
                heartbeat_interval=0.2,
                backoff_initial=0.1,
                backoff_max=0.5,
                slots=1,
            )
            sessions.append(AgentSession(config, SlowWords()))
    tasks = [asyncio.create_task(s.run()) for s in sessions]
    for session in sessions:
        await session.wait_for_state(AgentState.READY, timeout=20)
    yield sessions
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _store(schema: str) -> Controller:
    return Controller(persistence_env(TEST_DATABASE_URL, schema=schema, pool_size=2))


async def _first_tokens(ctl: ControllerProcess) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", ctl.url("/v1/chat/completions"), headers=AI, json=body) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if '"content":" w5"' in line:
                return  # streaming: now the controller dies under it


async def test_controller_killed_mid_stream_and_restarted(
    ctl: ControllerProcess, agents: list[AgentSession], pg_schema: str
) -> None:
    runs, drained = agents
    runs_id, drained_id = str(runs.node_id), str(drained.node_id)
    async with httpx.AsyncClient() as client:
        r = await client.post(ctl.url(f"/api/admin/nodes/{drained_id}/drain"), headers=ADMIN)
        assert r.status_code == 202 and r.json()["drain_requested"], r.text
    await _first_tokens(ctl)
    handler: Any = runs.handler
    [job_id] = handler.jobs
    connections = [s.connections for s in agents]
    ctl.kill()
    killed_at = time.monotonic()
    ctl.start()
    await until(lambda: _up(ctl), 60)
    await until(
        lambda: all(s.connections > c for s, c in zip(agents, connections, strict=True)), 30
    )
    back = time.monotonic() - killed_at
    store = _store(pg_schema)
    try:
        await until(
            lambda: (
                code_of(list(store.repository.event_store.get(UUID(job_id)))[-1]) == "JOB_FAILED"
            ),
            20,
        )
        failed_after = time.monotonic() - killed_at
        failed: Any = list(store.repository.event_store.get(UUID(job_id)))[-1]
        assert "controller restarted" in failed.reason
        assert failed.error_code == "controller_restarted"
        await until(lambda: str(store.get_node(runs_id).state) == "READY", 20)
        assert store.get_node(runs_id).jobs == []
        drained_node = store.get_node(drained_id)
        assert drained_node.drain_requested, drained_node.state  # the drain survived
        for session in agents:
            node_events = store.repository.event_store.get(UUID(str(session.node_id)))
            codes = [code_of(e) for e in node_events]
            assert codes.count("NODE_ENROLLED") == 1  # reconnected, not enrolled again
    finally:
        store.close()
    print(
        f"agents back {back:.2f}s after the kill; its job failed {failed_after:.2f}s after "
        f"(its lease ran out: {LEASE_TTL:g} s, reconciled every {RECONCILE_INTERVAL:g} s)"
    )
