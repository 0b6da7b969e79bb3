"""End to end: the OpenAI SDK → controller (real Postgres) → two agents → llama.cpp over RPC."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from application.controller import Controller
from domain.catalog import code_of
from domain.placement import ExecutionPlan
from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, admin, cluster_fixture, event_store, running

pytestmark = pytest.mark.timeout(900)


cluster = cluster_fixture(
    "cluster",
    # a + b hold the model with four 2,048-token slots; a alone cannot hold it.
    AgentSpec("agent-a", 0, memory_limit=200 * MIB, holds_model=True),
    AgentSpec("agent-b", 0, memory_limit=200 * MIB),
    AgentSpec("agent-c", 0, memory_limit=160 * MIB),
    own_schema=True,
    extra_env={
        "RPC_WORKER_START_TIMEOUT": "4",
        "DEGRADED_AFTER": "30",
        "OFFLINE_AFTER": "60",
    },
)


@pytest.fixture(scope="module")
def store(cluster: LocalCluster) -> Iterator[Controller]:
    with event_store(cluster) as app:
        yield app


def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0)


def job_id_of(completion_id: str) -> str:
    return str(uuid.UUID(completion_id.removeprefix("chatcmpl-")))


def job_timeline(store: Controller, job_id: str) -> list[tuple[int, str, Any]]:
    """(position, code, event) of the job's events and of node events about the job."""
    out = []
    for n in store.recorder.select_notifications(start=1, limit=1_000_000):
        event = store.mapper.to_domain_event(n)
        if str(event.originator_id) == job_id or getattr(event, "job_id", None) == job_id:
            out.append((n.id, code_of(event), event))
    return out


def wait_job(store: Controller, job_id: str, states: set[str], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        job = store.get_job(job_id)
        if job.state in states:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stayed {job.state}"
        time.sleep(0.1)


MESSAGES: list[Any] = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _flag(cmdline: list[str], flag: str) -> str:
    assert flag in cmdline, cmdline
    return cmdline[cmdline.index(flag) + 1]


def test_streaming_split_across_two_agents(cluster: LocalCluster, store: Controller) -> None:
    chunks = list(
        client(cluster).chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            stream=True,
            max_tokens=32,
            seed=3,
            temperature=0,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices and usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text.strip()

    job_id = job_id_of(chunks[0].id)
    job = wait_job(store, job_id, {"COMPLETED"})
    assert len(job.plan["workers"]) == 1  # a two-node split
    assert job.plan["tensor_split"][0] > 0 and job.plan["tensor_split"][1] > 0
    # The split names its devices: each node's CPU, through its ggml-rpc-server.
    assert job.plan["tier"] == "cpu_over_rpc" and job.plan["reasons"]
    devices = job.plan["devices"]
    assert [(d["device"], d["via_rpc"]) for d in devices] == [("CPU", True), ("CPU", True)]
    assert [d["node_id"] for d in devices] == [
        job.plan["primary"]["node_id"],
        job.plan["workers"][0]["node_id"],
    ]
    shares = [d["share"] for d in devices]
    assert shares == job.plan["tensor_split"]
    # ... and llama.cpp was started with them named: llama-server numbers RPC devices in
    # --rpc order (RPC0, RPC1), each worker exposes what -d gave it.
    servers = [
        cmdline
        for cmdline in running("llama-server", "--rpc")
        if [float(x) for x in _flag(cmdline, "--tensor-split").split(",")]
        == pytest.approx(shares, abs=1e-6)
    ]
    assert servers, running("llama-server", "--rpc")
    assert all(_flag(server, "--device") == "RPC0,RPC1" for server in servers)
    assert all(_flag(server, "--n-gpu-layers") == "99" for server in servers)
    workers = running("ggml-rpc-server", "--port")
    assert len(workers) >= 2 and all(_flag(w, "--device") == "CPU" for w in workers)
    codes = [code for _, code, _ in job_timeline(store, job_id)]
    order = ["JOB_DISPATCHED", "RPC_WORKER_STARTED", "TOKEN_STREAM_CHUNK", "JOB_COMPLETED"]
    positions = [codes.index(c) for c in order]
    assert positions == sorted(positions), codes
    assert codes.count("RPC_WORKER_STARTED") == 2  # the primary's own worker and the other
    recorded = "".join(
        d["text"]
        for _, code, event in job_timeline(store, job_id)
        if code == "TOKEN_STREAM_CHUNK"
        for d in event.deltas
    )
    assert recorded == text


def test_non_streaming(cluster: LocalCluster, store: Controller) -> None:
    completion = client(cluster).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=16, seed=3, temperature=0
    )
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert store.get_job(job_id_of(completion.id)).state == "COMPLETED"


def test_a_prompt_longer_than_the_context_is_a_400_context_length_exceeded(
    cluster: LocalCluster, store: Controller
) -> None:
    """llama-server refuses it (`exceed_context_size_error`); the client gets OpenAI's 400,
    streamed or not (nothing was sent before the refusal), and the node serves on. The context
    a job gets is the model's (2,048 tokens), not the server's whole cache (4 slots): a prompt
    of about 2,400 tokens is refused too. Each refusal is the client's error (JOB_REJECTED),
    which `dacp diagnose` never counts against the node."""
    admin_headers = admin(cluster)
    before = {
        j["job_id"]
        for j in httpx.get(
            f"{cluster.url}/api/admin/jobs?limit=200", headers=admin_headers, timeout=10
        ).json()["data"]
    }
    long: list[Any] = [{"role": "user", "content": "tell me about llamas " * 2000}]  # > 8,192
    just_over: list[Any] = [{"role": "user", "content": "llamas and alpacas " * 800}]
    for messages, stream in ((long, False), (long, True), (just_over, False)):
        with pytest.raises(openai.BadRequestError) as refused:
            client(cluster).chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=8,
                stream=stream,  # type: ignore[call-overload]
            )
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    completion = client(cluster).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, seed=3, temperature=0
    )
    assert store.get_job(job_id_of(completion.id)).state == "COMPLETED"
    rows = httpx.get(
        f"{cluster.url}/api/admin/jobs?limit=200", headers=admin_headers, timeout=10
    ).json()["data"]
    refused_jobs = [j for j in rows if j["job_id"] not in before and j["state"] != "COMPLETED"]
    assert [j["state"] for j in refused_jobs] == ["REJECTED"] * 3, refused_jobs
    assert {j["error_code"] for j in refused_jobs} == {"context_length_exceeded"}


def test_eight_concurrent_sdk_streams_all_succeed(cluster: LocalCluster, store: Controller) -> None:
    """Eight OpenAI SDK streams at once, no client retries: none is refused. One llama-server
    split over agent-a and agent-b runs with four slots, so four run at once on it and the
    others wait their turn in the admission queue instead of getting 503."""

    def stream(index: int) -> tuple[str, str]:
        chunks = list(
            client(cluster).chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": f"Count to {index + 2}."}],
                stream=True,
                max_tokens=24,
                seed=index,
                temperature=0,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks[0].id, text

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(stream, range(8)))
    assert all(text.strip() for _, text in results)
    job_ids = [job_id_of(completion_id) for completion_id, _ in results]
    jobs = [wait_job(store, job_id, {"COMPLETED", "FAILED"}) for job_id in job_ids]
    assert [job.state for job in jobs] == ["COMPLETED"] * 8
    plans = [ExecutionPlan.from_dict(job.plan) for job in jobs]
    assert {plan.runtime_key for plan in plans} == {plans[0].runtime_key}, "one server for all"
    assert plans[0].parallel >= 4 and len(plans[0].nodes) == 2
    # Generation windows (setup validated → completed) of at least four jobs overlap.
    windows = []
    for job_id in job_ids:
        times = {code: event.timestamp for _, code, event in job_timeline(store, job_id)}
        windows.append((times["JOB_SETUP_VALIDATED"], times["JOB_COMPLETED"]))
    peak = max(sum(1 for s, e in windows if s <= start < e) for start, _ in windows)
    assert peak >= 4, f"at most {peak} ran at once"
    queued = [
        job_id
        for job_id in job_ids
        if "JOB_QUEUED" in [code for _, code, _ in job_timeline(store, job_id)]
    ]
    assert queued, "with four slots, some of the eight must have waited"


def test_models_and_errors(cluster: LocalCluster) -> None:
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    with pytest.raises(openai.NotFoundError) as missing:
        client(cluster).chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client(cluster).chat.completions.create(model=MODEL_NAME, messages=[])
    assert bad.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as hot:
        client(cluster).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=7)
    assert hot.value.param == "temperature"
    wrong_key = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


def test_no_capacity_is_503_with_retry_after(cluster: LocalCluster) -> None:
    registered = httpx.post(
        f"{cluster.url}/api/admin/models",
        headers=admin(cluster),
        timeout=10,
        json={"name": "ghost", "sha256": "0" * 64, "file_name": "ghost.gguf"},
    )
    assert registered.status_code == 201
    response = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {cluster.ai_api_key}"},
        json={"model": "ghost", "messages": MESSAGES},
    )
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) > 0
    assert response.json()["error"]["code"] == "no_capacity"


def test_client_disconnect_cancels_the_job(cluster: LocalCluster, store: Controller) -> None:
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST",
            f"{cluster.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {cluster.ai_api_key}"},
            json={
                "model": MODEL_NAME,
                "messages": MESSAGES,
                "stream": True,
                "max_tokens": 400,
                "temperature": 0.8,
                "seed": 1,
            },
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        completion_id = httpx.Response(200, content=first[6:]).json()["id"]
        next(line for line in lines if '"content"' in line and '""' not in line)
    job = wait_job(store, job_id_of(completion_id), {"CANCELLED", "COMPLETED"})
    assert job.state == "CANCELLED"


def test_replans_when_a_worker_agent_dies_before_dispatch(
    cluster: LocalCluster, store: Controller
) -> None:
    """agent-b (the preferred worker) is frozen, as if killed but not yet noticed: its RPC
    worker never starts, the job is re-planned onto agent-c and still answers."""
    victim = cluster.agent_procs["agent-b"].popen
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        completion = client(cluster).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=16, seed=3, temperature=0
        )
    finally:
        os.kill(victim.pid, signal.SIGKILL)
        os.kill(victim.pid, signal.SIGCONT)
    assert completion.choices[0].message.content
    job_id = job_id_of(completion.id)
    timeline = job_timeline(store, job_id)
    codes = [code for _, code, _ in timeline]
    assert "JOB_REPLANNED" in codes
    replanned = next(event for _, code, event in timeline if code == "JOB_REPLANNED")
    assert replanned.excluded_node
    final_nodes = {
        replanned.plan["primary"]["node_id"],
        *(w["node_id"] for w in replanned.plan["workers"]),
    }
    assert replanned.excluded_node not in final_nodes
    assert store.get_job(job_id).state == "COMPLETED"
