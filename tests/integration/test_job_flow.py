"""The job manager's three phases over real gRPC, Postgres and Redis, with FakeAgents
standing in for llama.cpp (the real thing runs in tests/e2e)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest

from application.commands import Enrollment
from application.enrollment import credential_sha256
from domain.catalog import code_of
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.integration.control_client import RawSession, control_target
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token
from wire import control_pb2 as pb

SHA = "ab" * 32
AI = {"Authorization": "Bearer test-ai-key"}
ADMIN = {"Authorization": "Bearer test-admin-key"}
CHAT_X = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    settings = controller_settings(pg_schema, tmp_path, rpc_worker_timeout=1.0, setup_timeout=2.0)
    async with controller(settings) as running:
        yield running


async def agents(ctl: RunningController, *specs: dict[str, Any]) -> list[FakeAgent]:
    target = control_target(ctl)
    started = [await FakeAgent(target, token(), **spec).start() for spec in specs]
    deadline = time.monotonic() + 10
    while True:
        rows = await asyncio.to_thread(ctl.services.read_model.eligibility)
        if len(rows) == len(specs) and any(r["local_models"] for r in rows):
            return started
        assert time.monotonic() < deadline, rows
        await asyncio.sleep(0.05)


async def register(ctl: RunningController, client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/api/admin/models", headers=ADMIN, json={"name": "m", "sha256": SHA, "file_name": "m.gguf"}
    )
    assert r.status_code == 201, r.text


def http(ctl: RunningController) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=20)


@asynccontextmanager
async def chat_stream(ctl: RunningController) -> AsyncIterator[httpx.Response]:
    """The model registered, then one streamed chat request ("x" to model "m") open."""
    async with http(ctl) as client:
        await register(ctl, client)
        async with client.stream("POST", "/v1/chat/completions", headers=AI, json=CHAT_X) as r:
            yield r


async def slow_primary(ctl: RunningController, words: int = 200) -> FakeAgent:
    """One agent holding the model that streams ``words`` tokens 20 ms apart."""
    (a,) = await agents(
        ctl,
        {
            "name": "a",
            "holds": SHA,
            "memory": 4 << 30,
            "words": tuple(f" w{i}" for i in range(words)),
        },
    )
    a.word_delay = 0.02
    return a


async def chat_once(client: httpx.AsyncClient, content: str = "x") -> httpx.Response:
    """One non-streamed chat completion of model ``m``, however it is answered."""
    return await client.post(
        "/v1/chat/completions",
        headers=AI,
        json={"model": "m", "messages": [{"role": "user", "content": content}]},
    )


async def complete_once(ctl: RunningController) -> httpx.Response:
    """Registers model ``m`` and asks for one non-streamed completion."""
    async with http(ctl) as client:
        await register(ctl, client)
        return await chat_once(client)


def synced(ctl: RunningController) -> RunningController:
    """Waits until the read model has seen every recorded event."""
    ctl.services.follower.wait(ctl.services.app.position(), timeout=5)
    return ctl


def job_codes(ctl: RunningController, job_id: str) -> list[str]:
    return [code_of(e) for e in ctl.services.app.repository.event_store.get(UUID(job_id))]


def job_id(completion_id: str) -> str:
    import uuid

    return str(uuid.UUID(completion_id.removeprefix("chatcmpl-")))


async def test_one_node_plan_when_the_model_fits(ctl: RunningController) -> None:
    (a,) = await agents(ctl, {"name": "a", "holds": SHA, "memory": 4 << 30})
    r = await complete_once(ctl)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Hello world"
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    jid = job_id(body["id"])
    codes = job_codes(ctl, jid)
    collapsed = [c for i, c in enumerate(codes) if i == 0 or c != codes[i - 1]]
    assert collapsed == [
        "JOB_SUBMITTED",
        "JOB_PLANNED",
        "JOB_DISPATCHED",
        "JOB_SETUP_VALIDATED",
        "TOKEN_STREAM_CHUNK",
        "JOB_COMPLETED",
    ]
    assert len(a.plans) == 1 and not a.plans[0].rpc_peers  # no RPC for a one-node plan
    await a.stop()


async def test_split_plan_streams_and_records_in_order(ctl: RunningController) -> None:
    a, b = await agents(ctl, {"name": "a", "holds": SHA}, {"name": "b"})
    async with http(ctl) as client:
        await register(ctl, client)
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            headers=AI,
            json={
                "model": "m",
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "x"}],
            },
        ) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import orjson

    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == "Hello world"
    )
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    plan = a.plans[0]
    assert [p.node_id for p in plan.rpc_peers] == [a.node_id, b.node_id]
    assert abs(sum(plan.tensor_split) - 1.0) < 1e-6
    jid = job_id(chunks[0]["id"])
    # The ending is recorded before the client hears it: no waiting needed.
    assert "JOB_COMPLETED" in job_codes(ctl, jid)
    row = synced(ctl).services.read_model.get_job(jid)
    assert row is not None and row["text"] == "Hello world"
    for agent in (a, b):
        await agent.stop()


async def test_unresponsive_worker_is_replanned_away(ctl: RunningController) -> None:
    a, b, c = await agents(
        ctl,
        {"name": "a", "holds": SHA},
        {"name": "b", "memory": 300 << 20},
        {"name": "c", "memory": 200 << 20},
    )
    b.unresponsive = True
    r = await complete_once(ctl)
    assert r.status_code == 200, r.text
    jid = job_id(r.json()["id"])
    codes = job_codes(ctl, jid)
    assert codes.count("JOB_REPLANNED") == 1
    events = list(ctl.services.app.repository.event_store.get(UUID(jid)))
    replanned = next(e for e in events if code_of(e) == "JOB_REPLANNED")
    assert replanned.excluded_node == b.node_id  # type: ignore[attr-defined]
    assert [p.node_id for p in a.plans[-1].rpc_peers] == [a.node_id, c.node_id]
    node_b = ctl.services.app.get_node(b.node_id)
    assert str(jid) not in node_b.jobs  # released when re-planned
    for agent in (a, b, c):
        await agent.stop()


async def test_setup_failure_everywhere_gives_503(ctl: RunningController) -> None:
    from wire import control_pb2 as pb

    (a,) = await agents(ctl, {"name": "a", "holds": SHA, "memory": 4 << 30})
    a.fail_setup = pb.SetupResult(ok=False, error="sha256 differs", error_code="SHA256_MISMATCH")
    r = await complete_once(ctl)
    assert r.status_code == 503
    assert "SHA256_MISMATCH" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    jobs = synced(ctl).services.read_model.list_jobs()
    assert jobs[0]["state"] == "FAILED" and jobs[0]["failure_phase"] == "setup"
    assert ctl.services.app.get_node(a.node_id).jobs == []
    await a.stop()


async def test_client_disconnect_cancels(ctl: RunningController) -> None:
    a = await slow_primary(ctl)
    async with chat_stream(ctl) as r:
        async for line in r.aiter_lines():
            if '"content":" w' in line:
                break
    deadline = time.monotonic() + 10
    while True:
        jobs = ctl.services.read_model.list_jobs()
        if jobs and jobs[0]["state"] == "CANCELLED":
            break
        assert time.monotonic() < deadline, jobs
        await asyncio.sleep(0.05)
    assert a.cancelled == [jobs[0]["job_id"]]
    assert ctl.services.app.get_node(a.node_id).jobs == []
    await a.stop()


async def test_primary_lost_during_execution_fails_job_and_client_sees_error(
    ctl: RunningController,
) -> None:
    a = await slow_primary(ctl)
    async with chat_stream(ctl) as r:
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if len(lines) == 6:
                await a.stop()
    errors = [line for line in lines if '"error"' in line]
    assert errors and "lost during execution" in errors[0]
    jobs = synced(ctl).services.read_model.list_jobs()
    job = ctl.services.app.get_job(jobs[0]["job_id"])
    assert job.state == "FAILED" and job.failure_phase == "execution"


async def test_peer_outside_allowed_cidrs_is_excluded_and_recorded(
    ctl: RunningController,
) -> None:
    """203.0.113.9 (TEST-NET-3, never contacted) lies outside ALLOWED_PEER_CIDRS. Enrollment
    refuses such an address now, so the node is one enrolled before the CIDRs were narrowed:
    written to the store directly, then connecting with its credential."""
    credential = "public-node-credential"
    public_id = str(
        ctl.services.app.enroll(
            Enrollment(
                name="public",
                inventory={"ram_total_bytes": 8 << 30, "gpus": []},
                agent_version="fake",
                address="203.0.113.9",
                rpc_port=50052,
                labels={},
                credential_sha256=credential_sha256(credential),
                token_id="before-the-cidrs-changed",
                single_use_token=False,
            )
        ).aggregate_id
    )
    a, public, c = await agents(
        ctl,
        {"name": "a", "holds": SHA},
        {
            "name": "public",
            "memory": 4 << 30,
            "address": "203.0.113.9",
            "enrolled": (public_id, credential),
        },
        {"name": "c", "memory": 200 << 20},
    )
    r = await complete_once(ctl)
    assert r.status_code == 200, r.text
    jid = job_id(r.json()["id"])
    assert [p.node_id for p in a.plans[-1].rpc_peers] == [a.node_id, c.node_id]
    events = list(ctl.services.app.repository.event_store.get(UUID(public.node_id)))
    violation = next(e for e in events if code_of(e) == "SECURITY_VIOLATION")
    assert violation.address == "203.0.113.9"  # type: ignore[attr-defined]
    assert violation.job_id == jid  # type: ignore[attr-defined]
    assert public.session is not None
    kinds = [m.WhichOneof("payload") for m in public.session.received]
    assert "start_rpc_worker" not in kinds and "execution_plan" not in kinds
    for agent in (a, public, c):
        await agent.stop()


async def test_tokens_from_a_node_that_does_not_lead_the_job_are_ignored(
    ctl: RunningController,
) -> None:
    from wire import control_pb2 as pb

    a, b = await agents(
        ctl,
        {"name": "a", "holds": SHA, "memory": 4 << 30, "words": tuple(f" w{i}" for i in range(20))},
        {"name": "b"},
    )
    a.word_delay = 0.02
    async with http(ctl) as client:
        await register(ctl, client)
        request = asyncio.create_task(chat_once(client))
        while not a.plans:
            await asyncio.sleep(0.01)
        assert b.session is not None
        forged = pb.TokenChunk(
            job_id=a.plans[0].job_id, deltas=[pb.Delta(seq=0, text=" FORGED", tokens=1)]
        )
        await b.session.send(pb.AgentMessage(token_chunk=forged))
        r = await request
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "".join(f" w{i}" for i in range(20))
    row = synced(ctl).services.read_model.get_job(job_id(r.json()["id"]))
    assert row is not None and "FORGED" not in row["text"]
    for agent in (a, b):
        await agent.stop()


async def test_token_batches_survive_a_store_error(
    ctl: RunningController, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = ctl.services.app
    real = app.record_token_chunks
    calls = {"n": 0}

    def flaky(chunks: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("the database blinked")
        return real(chunks)

    monkeypatch.setattr(app, "record_token_chunks", flaky)
    (a,) = await agents(
        ctl,
        {"name": "a", "holds": SHA, "memory": 4 << 30, "words": tuple(f" w{i}" for i in range(30))},
    )
    a.word_delay = 0.02
    r = await complete_once(ctl)
    assert r.status_code == 200
    jid = job_id(r.json()["id"])
    assert calls["n"] > 1
    assert "JOB_COMPLETED" in job_codes(ctl, jid)
    row = synced(ctl).services.read_model.get_job(jid)
    assert row is not None and row["text"] == "".join(f" w{i}" for i in range(30))
    await a.stop()


async def test_a_primary_that_sends_no_token_in_time_ends_the_request_with_504(
    pg_schema: str, tmp_path: Path
) -> None:
    settings = controller_settings(pg_schema, tmp_path, first_token_timeout=1.0)
    async with controller(settings) as running:
        (a,) = await agents(running, {"name": "a", "holds": SHA, "memory": 4 << 30})
        a.word_delay = 5.0  # validates, then stays silent longer than the limit
        started = time.monotonic()
        r = await complete_once(running)
        took = time.monotonic() - started
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "first_token_timeout"
        assert 1.0 < took < 4.0
        jid = a.plans[0].job_id
        await asyncio.sleep(0.2)
        assert job_codes(running, jid)[-1] == "JOB_FAILED"
        assert running.services.app.get_node(a.node_id).jobs == []
        assert jid in a.cancelled  # the primary was told to stop
        await a.stop()


async def test_a_5_mb_prompt_fails_alone_and_the_node_keeps_its_stream(
    ctl: RunningController,
) -> None:
    (a,) = await agents(ctl, {"name": "a", "holds": SHA, "memory": 4 << 30})
    async with http(ctl) as client:
        await register(ctl, client)
        huge = {"model": "m", "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
        r = await client.post("/v1/chat/completions", headers=AI, json=huge)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == "request_too_large" and "MAX_REQUEST_BYTES" in error["message"]
        assert a.plans == []  # nothing went down the node's stream
        assert ctl.services.connections.is_connected(a.node_id)
        # A request just under the limit (4 MiB) goes all the way: its plan reaches the node.
        limit = ctl.services.settings.max_request_bytes
        content = "x" * (limit - 1024)
        almost = {"model": "m", "messages": [{"role": "user", "content": content}]}
        r = await client.post("/v1/chat/completions", headers=AI, json=almost)
        assert r.status_code == 200, r.text
        assert len(a.plans) == 1 and content in a.plans[0].chat.messages_json
    codes = [code_of(e) for e in ctl.services.app.repository.event_store.get(UUID(a.node_id))]
    assert "NODE_OFFLINE" not in codes
    await a.stop()


async def test_a_primary_whose_stream_breaks_resumes_its_job_when_back(
    ctl: RunningController,
) -> None:
    """The stream breaks mid-generation (no goodbye): the job waits; the agent's new stream is
    told where the job's tokens resume, and what it re-sends twice is relayed once."""
    (a,) = await agents(ctl, {"name": "a", "holds": SHA, "memory": 4 << 30})
    a.unresponsive = True  # this test answers for it
    old = a.session
    assert old is not None

    def delta(job: str, seq: int, text: str) -> pb.AgentMessage:
        d = pb.Delta(seq=seq, text=text, tokens=1)
        return pb.AgentMessage(token_chunk=pb.TokenChunk(job_id=job, deltas=[d]))

    async with http(ctl) as client:
        await register(ctl, client)
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        answer = asyncio.create_task(client.post("/v1/chat/completions", headers=AI, json=body))
        deadline = time.monotonic() + 10
        while not any(m.WhichOneof("payload") == "execution_plan" for m in old.received):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        [job] = [m.execution_plan.job_id for m in old.received if m.HasField("execution_plan")]
        ok = pb.SetupResult(job_id=job, ok=True, role="primary")
        await old.send(pb.AgentMessage(setup_result=ok))
        await old.send(delta(job, 0, "a"))
        await old.send(delta(job, 1, " b"))
        jobs = ctl.jobs
        while jobs.runs[job].next_seq < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await old.drop()
        again = RawSession(old.target, a.node_id, old.credential)
        welcome = (await again.open()).welcome
        assert [(r.job_id, r.next_seq) for r in welcome.resumed_jobs] == [(job, 2)]
        await again.send(delta(job, 1, " b"))  # in flight when the stream broke: again
        await again.send(delta(job, 2, " c"))
        done = pb.JobResult(job_id=job, ok=True, finish_reason="stop", completion_tokens=3)
        await again.send(pb.AgentMessage(job_result=done))
        r = await asyncio.wait_for(answer, 20)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "a b c"
    assert job_codes(ctl, job)[-1] == "JOB_COMPLETED"
    node_events = ctl.services.app.repository.event_store.get(UUID(a.node_id))
    assert "NODE_OFFLINE" not in [code_of(e) for e in node_events]
    await again.close()
