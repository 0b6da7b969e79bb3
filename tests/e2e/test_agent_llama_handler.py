"""The agent's LlamaHandler driven with real protobuf messages, real llama.cpp and a real model.

Each handler plays one node; ``send`` collects what it would stream to the controller. The
llama.cpp binaries and SmolLM2-135M-Instruct come from ``ops.paths`` (built or fetched on a cold
cache, about 5 minutes once).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from agent.runtime.endpoints import free_loopback_port
from agent.runtime.llama_binaries import RuntimeBinaries, find_binaries
from agent.runtime.llama_handler import LlamaHandler
from agent.runtime.rpc_filter import PeerFilter
from ops.artifacts import ensure_llama, ensure_model
from ops.paths import MODEL_SHA256
from tests.integration.fake_control_plane import GOOD_TOKEN
from wire import control_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
LONG_PROMPT = [{"role": "user", "content": "Write a very long essay about the history of Rome."}]


@pytest.fixture(scope="module")
def binaries() -> RuntimeBinaries:
    return find_binaries(ensure_llama())


@pytest.fixture(scope="module")
def node_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(models dir holding a link to the cached model, data dir) shared by the module, so the
    model is hashed once."""
    root = tmp_path_factory.mktemp("node")
    models = root / "models"
    models.mkdir()
    model = ensure_model()
    (models / model.name).symlink_to(model)
    return models, root / "data"


class Collector:
    """A ``send`` that records every AgentMessage."""

    def __init__(self) -> None:
        self.messages: list[pb.AgentMessage] = []

    async def __call__(self, message: pb.AgentMessage) -> None:
        self.messages.append(message)

    def of(self, kind: str, job_id: str | None = None) -> list[pb.AgentMessage]:
        found = [m for m in self.messages if m.WhichOneof("payload") == kind]
        if job_id is not None:
            found = [m for m in found if getattr(m, kind).job_id == job_id]
        return found

    async def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
    ) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                kinds = [m.WhichOneof("payload") for m in self.messages]
                raise AssertionError(f"{what} not met within {timeout}s; got {kinds}")
            await asyncio.sleep(0.01)

    def job_messages(self, job_id: str) -> list[tuple[str, pb.AgentMessage]]:
        out = []
        for message in self.messages:
            kind = message.WhichOneof("payload")
            if kind in ("setup_result", "token_chunk", "job_result"):
                if getattr(message, kind).job_id == job_id:
                    out.append((kind, message))
        return out


HandlerFactory = Callable[[], LlamaHandler]


@pytest.fixture
async def make_handler(
    binaries: RuntimeBinaries, node_dirs: tuple[Path, Path], tmp_path: Path
) -> AsyncIterator[HandlerFactory]:
    models, data = node_dirs
    handlers: list[LlamaHandler] = []

    def make() -> LlamaHandler:
        handler = LlamaHandler(
            binaries,
            models_dir=models,
            data_dir=data,
            log_dir=tmp_path / f"logs-{len(handlers)}",
            probe_timeout=1.0,
            start_timeout=90.0,
        )
        handlers.append(handler)
        return handler

    yield make
    for handler in handlers:
        await handler.close()
        assert handler.runtime.server is None and handler.runtime.rpc_workers == {}


def make_plan(
    job_id: str,
    *,
    peers: Sequence[tuple[str, str, int]] = (),
    split: Sequence[float] = (),
    sha256: str = MODEL_SHA256,
    messages: object = PROMPT,
    max_tokens: int = 24,
) -> pb.ExecutionPlan:
    return pb.ExecutionPlan(
        job_id=job_id,
        role=pb.ExecutionPlan.PRIMARY,
        model_name="smollm2-135m",
        model_file_name=ensure_model().name,
        model_sha256=sha256,
        context_size=1024,
        rpc_peers=[pb.RpcPeer(node_id=n, host=h, port=p) for n, h, p in peers],
        tensor_split=list(split),
        generation=pb.GenerationParams(max_tokens=max_tokens, temperature=0.0, seed=42),
        chat=pb.ChatJob(messages_json=json.dumps(messages)),
    )


def assert_streamed_job(sent: Collector, job_id: str) -> pb.JobResult:
    """SetupResult ok, then TokenChunks with contiguous seq from 0, then JobResult ok."""
    messages = sent.job_messages(job_id)
    kinds = [kind for kind, _ in messages]
    assert kinds[0] == "setup_result" and kinds[-1] == "job_result", kinds
    assert set(kinds[1:-1]) == {"token_chunk"}, kinds
    setup = messages[0][1].setup_result
    assert (setup.ok, setup.role, setup.error) == (True, "primary", "")
    deltas = [d for _, m in messages[1:-1] for d in m.token_chunk.deltas]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert all(d.tokens == 1 for d in deltas)
    assert "".join(d.text for d in deltas).strip()
    result = messages[-1][1].job_result
    assert result.ok, result
    assert result.finish_reason in ("stop", "length")
    assert result.completion_tokens >= len([d for d in deltas if d.text]) - 1
    assert result.prompt_tokens > 0
    assert result.time_to_first_token_ms > 0 and result.tokens_per_second > 0
    return result


async def start_worker(handler: LlamaHandler, sent: Collector, job_id: str, port: int) -> None:
    await handler.on_start_rpc_worker(
        pb.StartRpcWorker(job_id=job_id, host="127.0.0.1", port=port, allowed_peers=["127.0.0.1"]),
        sent,
    )
    status = sent.of("rpc_worker_status", job_id)[-1].rpc_worker_status
    assert (status.state, status.host, status.port, status.error) == (
        pb.RpcWorkerStatus.STARTED,
        "127.0.0.1",
        port,
        "",
    )


async def test_one_node_plan_streams_tokens(make_handler: HandlerFactory) -> None:
    handler = make_handler()
    sent = Collector()

    await handler.on_plan(make_plan("job-1", max_tokens=32), sent)

    result = assert_streamed_job(sent, "job-1")
    assert result.completion_tokens <= 32
    assert len(sent.of("token_chunk")) > 1  # streamed, not one blob
    assert handler.active_job_ids() == []
    server = handler.runtime.server
    assert server is not None and server.spec.rpc_endpoints == ()


async def test_two_node_split_plan_reuses_the_warm_server(make_handler: HandlerFactory) -> None:
    primary, other = make_handler(), make_handler()
    sent_primary, sent_other = Collector(), Collector()
    port_a, port_b = free_loopback_port(), free_loopback_port()
    while port_b == port_a:
        port_b = free_loopback_port()
    peers = [("node-a", "127.0.0.1", port_a), ("node-b", "127.0.0.1", port_b)]

    pids: list[int | None] = []
    worker_pids: list[int | None] = []
    for n in range(3):  # more than ggml-rpc-server's accept queue holds
        job = f"split-{n}"
        await start_worker(primary, sent_primary, job, port_a)
        await start_worker(other, sent_other, job, port_b)
        worker = other.rpc_worker  # on 127.0.0.1:port_b itself, its accept filter loaded
        assert worker is not None and worker.port == port_b
        assert isinstance(other.rpc_host.guard, PeerFilter)
        worker_pids.append(worker.pid)

        await primary.on_plan(make_plan(job, peers=peers, split=[0.5, 0.5]), sent_primary)

        assert_streamed_job(sent_primary, job)
        server = primary.runtime.server
        assert server is not None
        assert server.spec.rpc_endpoints == (f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}")
        assert server.spec.tensor_split == (0.5, 0.5)
        pids.append(server.pid)
    assert len(set(pids)) == 1, f"warm llama-server was not reused: {pids}"
    assert len(set(worker_pids)) == 1, "a running RPC worker must be reused"
    # Both workers really hold part of the model.
    log = primary.runtime.server.log_text() if primary.runtime.server else ""
    for port in (port_a, port_b):
        assert f"[127.0.0.1:{port}] model buffer size" in log

    # A worker that dies while idle is reported; the primary's warm server lost its link to
    # it, so once the worker is back the next plan gets a fresh llama-server that works.
    worker_b = other.rpc_worker
    assert worker_b is not None
    worker_b.kill()
    await sent_other.wait_for(lambda: bool(sent_other.of("runtime_fault")), what="RuntimeFault")
    fault = sent_other.of("runtime_fault")[0].runtime_fault
    assert not fault.fatal and f"127.0.0.1:{port_b}" in fault.message
    await start_worker(other, sent_other, "split-again", port_b)
    await start_worker(primary, sent_primary, "split-again", port_a)
    await primary.on_plan(make_plan("split-again", peers=peers, split=[0.5, 0.5]), sent_primary)
    assert_streamed_job(sent_primary, "split-again")
    assert primary.runtime.server is not None and primary.runtime.server.pid not in pids


async def test_wrong_sha256_is_refused(make_handler: HandlerFactory) -> None:
    handler = make_handler()
    sent = Collector()

    await handler.on_plan(make_plan("bad-sha", sha256="0" * 64), sent)

    [message] = sent.job_messages("bad-sha")
    result = message[1].setup_result
    assert (result.ok, result.error_code, result.role) == (False, "SHA256_MISMATCH", "primary")
    assert MODEL_SHA256 in result.error and "0" * 64 in result.error
    assert handler.runtime.server is None  # nothing started for a bad model


async def test_unreachable_peer_is_blamed(make_handler: HandlerFactory) -> None:
    primary = make_handler()
    sent = Collector()
    port_a, dead_port = free_loopback_port(), free_loopback_port()
    await start_worker(primary, sent, "peer-gone", port_a)
    peers = [("node-a", "127.0.0.1", port_a), ("node-gone", "127.0.0.1", dead_port)]

    started = time.monotonic()
    await primary.on_plan(make_plan("peer-gone", peers=peers, split=[0.5, 0.5]), sent)

    assert time.monotonic() - started < 5
    [message] = sent.job_messages("peer-gone")
    result = message[1].setup_result
    assert (result.ok, result.error_code, result.failed_node_id) == (
        False,
        "RPC_PEER_UNREACHABLE",
        "node-gone",
    )
    assert f"127.0.0.1:{dead_port}" in result.error
    assert primary.runtime.server is None


async def test_cancel_stops_generation_quickly(make_handler: HandlerFactory) -> None:
    handler = make_handler()
    sent = Collector()
    plan = make_plan("long", messages=LONG_PROMPT, max_tokens=1500)

    job = asyncio.create_task(handler.on_plan(plan, sent))
    await sent.wait_for(lambda: len(sent.of("token_chunk", "long")) >= 2, timeout=60)
    assert handler.active_job_ids() == ["long"]
    cancelled_at = time.monotonic()
    await handler.on_cancel(pb.CancelJob(job_id="long", reason="client went away"), sent)
    await asyncio.wait_for(job, timeout=5)

    assert time.monotonic() - cancelled_at < 2
    result = sent.of("job_result", "long")[-1].job_result
    assert (result.ok, result.finish_reason, result.error_code, result.phase) == (
        False,
        "cancelled",
        "CANCELLED",
        "execution",
    )
    kinds = [kind for kind, _ in sent.job_messages("long")]
    assert kinds[-1] == "job_result" and kinds.count("job_result") == 1
    deltas = [d for m in sent.of("token_chunk", "long") for d in m.token_chunk.deltas]
    assert [d.seq for d in deltas] == list(range(len(deltas))) and len(deltas) < 1500
    assert handler.active_job_ids() == []

    # The slot is free at once: a short job does not wait behind 1500 tokens.
    started = time.monotonic()
    await handler.on_plan(make_plan("after-cancel", max_tokens=8), sent)
    assert_streamed_job(sent, "after-cancel")
    assert time.monotonic() - started < 10


def test_missing_binaries_exit_2_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DACP_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.main",
            "--controller-url",
            "127.0.0.1:1",
            "--enrollment-token",
            GOOD_TOKEN,  # well-formed (the agent checks that first), never sent
            "--data-dir",
            str(tmp_path / "data"),
            "--llama-bin-dir",
            "/nonexistent",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("node-agent: error: llama.cpp runtime unavailable")
    assert "/nonexistent" in lines[0] and "make llama" in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
