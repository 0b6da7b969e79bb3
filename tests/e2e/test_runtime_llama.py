"""The agent's llama.cpp runtime against real binaries and a real model.

The session fixtures build llama.cpp and fetch SmolLM2-135M-Instruct through ``ops.paths`` if
they are not cached yet (about 5 minutes, once), so these tests never skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agent.runtime.endpoints import free_loopback_port
from agent.runtime.llama_binaries import RuntimeBinaries, find_binaries
from agent.runtime.llama_server import ChatDelta, ChatRequest, LlamaServer
from agent.runtime.managed_child import ProcessExit
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.runtime import RuntimeManager
from agent.runtime.runtime_errors import (
    GenerationError,
    LlamaRuntimeError,
    PortInUseError,
    RuntimeCrashedError,
    RuntimeMissingError,
    UnsafeBindError,
)
from agent.runtime.server_spec import ServerSpec
from ops.artifacts import ensure_llama, ensure_model

# A cold cache builds llama.cpp inside the first test's setup (~5 min on 2 cores).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="session")
def binaries() -> RuntimeBinaries:
    return find_binaries(ensure_llama())


@pytest.fixture(scope="session")
def model_file() -> Path:
    return ensure_model()


class ExitRecorder:
    def __init__(self) -> None:
        self.exits: list[ProcessExit] = []
        self._event = threading.Event()

    def __call__(self, info: ProcessExit) -> None:
        self.exits.append(info)
        self._event.set()

    def wait_for(self, role: str, timeout: float = 10.0) -> ProcessExit:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for info in self.exits:
                if info.role == role:
                    return info
            self._event.wait(0.1)
            self._event.clear()
        raise AssertionError(f"no exit reported for {role}; got {self.exits}")


@pytest.fixture
def exits() -> ExitRecorder:
    return ExitRecorder()


@pytest.fixture
def manager(
    binaries: RuntimeBinaries, tmp_path: Path, exits: ExitRecorder
) -> Iterator[RuntimeManager]:
    with RuntimeManager(binaries, tmp_path / "logs", on_exit=exits, start_timeout=90) as mgr:
        yield mgr


async def collect(server: LlamaServer, request: ChatRequest) -> tuple[list[ChatDelta], float]:
    started = time.monotonic()
    deltas = [delta async for delta in server.stream_chat(request)]
    return deltas, time.monotonic() - started


def text_of(deltas: list[ChatDelta]) -> str:
    return "".join(delta.text for delta in deltas)


def final_timings_rate(deltas: list[ChatDelta]) -> float:
    timings = [delta.timings for delta in deltas if delta.timings is not None]
    assert timings, "llama-server sent no timings"
    return timings[-1].tokens_per_second


async def test_single_server_streams_chat_tokens(manager: RuntimeManager, model_file: Path) -> None:
    server = await manager.ensure_server_async(ServerSpec(str(model_file), ctx_size=1024))
    assert server.health()
    max_tokens = 48
    request = ChatRequest(messages=PROMPT, max_tokens=max_tokens, temperature=0.0, seed=7)

    deltas, _ = await collect(server, request)

    text_deltas = [delta for delta in deltas if delta.text]
    assert len(text_deltas) >= 5, deltas  # streamed piece by piece, not one blob
    assert text_of(deltas).strip()
    assert any(delta.finish_reason in {"stop", "length"} for delta in deltas)
    usage = next(delta.usage for delta in deltas if delta.usage is not None)
    # Every streamed piece is at least one generated token (a token may stream no text).
    assert len(text_deltas) <= usage.completion_tokens <= max_tokens
    if any(delta.finish_reason == "length" for delta in deltas):
        assert usage.completion_tokens == max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    print(f"single llama-server: {final_timings_rate(deltas):.1f} tokens/s")


async def test_split_over_two_rpc_workers_streams_tokens_and_uses_them(
    manager: RuntimeManager, model_file: Path, exits: ExitRecorder
) -> None:
    ports = sorted({free_loopback_port() for _ in range(4)})[:2]
    assert len(ports) == 2
    workers = [manager.start_rpc_worker("127.0.0.1", port) for port in ports]
    rss_before = [psutil.Process(w.pid).memory_info().rss for w in workers if w.pid]
    spec = ServerSpec(
        str(model_file),
        ctx_size=1024,
        rpc_endpoints=tuple(worker.endpoint for worker in workers),
        tensor_split=(1.0, 1.0),
    )
    server = await manager.ensure_server_async(spec)
    cpu_before = [sum(psutil.Process(w.pid).cpu_times()[:2]) for w in workers if w.pid]

    request = ChatRequest(messages=PROMPT, max_tokens=48, temperature=0.0, seed=7)
    deltas, _ = await collect(server, request)
    assert len([delta for delta in deltas if delta.text]) >= 5
    assert text_of(deltas).strip()
    print(f"split over 2 RPC workers: {final_timings_rate(deltas):.1f} tokens/s")

    # Proof 1: llama-server placed weights and KV cache on both workers.
    log = server.log_text()
    for worker in workers:
        match = re.search(
            rf"\[{re.escape(worker.endpoint)}\] model buffer size = +([\d.]+) MiB", log
        )
        assert match and float(match.group(1)) > 10, f"no weights on {worker.endpoint}"
        assert re.search(rf"\[{re.escape(worker.endpoint)}\] KV buffer size", log)
    # Proof 2: the workers hold the weights and did the compute.
    for worker, rss, cpu in zip(workers, rss_before, cpu_before, strict=True):
        assert worker.pid is not None
        process = psutil.Process(worker.pid)
        assert process.memory_info().rss > rss + 10 * 1024 * 1024
        assert sum(process.cpu_times()[:2]) > cpu
    # Proof 3: without a worker the primary cannot generate.
    workers[1].kill()
    assert exits.wait_for("ggml-rpc-server").exit_code == -signal.SIGKILL
    with pytest.raises((RuntimeCrashedError, GenerationError)):
        await collect(server, request)
    crash = exits.wait_for("llama-server")
    assert "RPC" in "\n".join(crash.stderr_tail)
    with pytest.raises(RuntimeCrashedError):
        server.check()


async def test_warm_server_is_reused_for_an_equal_spec(
    manager: RuntimeManager, model_file: Path
) -> None:
    assert manager.running_server(ServerSpec(str(model_file), ctx_size=1024)) is None
    first = await manager.ensure_server_async(ServerSpec(str(model_file), ctx_size=1024))
    again = await manager.ensure_server_async(ServerSpec(str(model_file), ctx_size=1024))
    assert again is first and again.pid == first.pid and first.alive
    assert manager.running_server(ServerSpec(str(model_file), ctx_size=1024)) is first
    assert manager.running_server(ServerSpec(str(model_file), ctx_size=512)) is None

    other = await manager.ensure_server_async(ServerSpec(str(model_file), ctx_size=512))
    assert other is not first and other.pid != first.pid
    assert not first.alive  # replaced, not leaked
    assert manager.running_server(ServerSpec(str(model_file), ctx_size=1024)) is None


async def test_killed_llama_server_is_detected_and_replaced(
    manager: RuntimeManager, model_file: Path, exits: ExitRecorder
) -> None:
    spec = ServerSpec(str(model_file), ctx_size=512)
    server = await manager.ensure_server_async(spec)
    old_pid = server.pid
    server.kill()

    info = exits.wait_for("llama-server")
    assert info.pid == old_pid and info.exit_code == -signal.SIGKILL
    with pytest.raises(RuntimeCrashedError, match="SIGKILL"):
        server.check()
    with pytest.raises(RuntimeCrashedError):
        await collect(server, ChatRequest(messages=PROMPT, max_tokens=4))

    replacement = await manager.ensure_server_async(spec)
    assert replacement.alive and replacement.pid != old_pid


async def test_closing_the_stream_cancels_generation(
    manager: RuntimeManager, model_file: Path
) -> None:
    server = await manager.ensure_server_async(ServerSpec(str(model_file), ctx_size=2048))
    long_request = ChatRequest(
        messages=[
            {"role": "user", "content": "Write a very long essay about the history of Rome."}
        ],
        max_tokens=1500,
        temperature=0.0,
    )
    stream = server.stream_chat(long_request)
    received = 0
    async for delta in stream:
        received += bool(delta.text)
        if received == 3:
            break
    await stream.aclose()

    # The single slot is free again at once; otherwise this would wait for 1500 tokens.
    deltas, elapsed = await collect(server, ChatRequest(messages=PROMPT, max_tokens=4))
    assert text_of(deltas) and elapsed < 10
    log = server.log_text()
    assert "cancel task" in log
    released = [int(n) for n in re.findall(r"task 0 \| stop processing: n_tokens = (\d+)", log)]
    assert released and released[0] < 200


async def test_llama_server_error_is_reported(manager: RuntimeManager, model_file: Path) -> None:
    server = await manager.ensure_server_async(ServerSpec(str(model_file), ctx_size=512))
    with pytest.raises(GenerationError) as caught:
        too_long = [{"role": "user", "content": "lorem ipsum " * 600}]  # > 512 tokens
        await collect(server, ChatRequest(messages=too_long, max_tokens=8))
    assert caught.value.status_code is not None and 400 <= caught.value.status_code < 500
    assert "context" in str(caught.value)
    assert server.alive  # a bad request does not take the server down


def test_missing_binary_raises_runtime_missing_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeMissingError, match="llama-server not found"):
        find_binaries(tmp_path)
    (tmp_path / "llama-server").write_bytes(b"")
    (tmp_path / "llama-server").chmod(0o755)
    with pytest.raises(RuntimeMissingError, match="ggml-rpc-server not found"):
        find_binaries(tmp_path)


def test_rpc_worker_refuses_wildcard_bind(
    manager: RuntimeManager, binaries: RuntimeBinaries, tmp_path: Path
) -> None:
    with pytest.raises(UnsafeBindError, match=r"0\.0\.0\.0"):
        manager.start_rpc_worker("0.0.0.0", free_loopback_port())
    with pytest.raises(UnsafeBindError):
        RpcWorker(binaries, "0.0.0.0", 50052, log_dir=tmp_path)
    assert manager.rpc_workers == {}


def test_rpc_worker_port_conflict_is_refused(
    manager: RuntimeManager, binaries: RuntimeBinaries, tmp_path: Path
) -> None:
    port = free_loopback_port()
    worker = manager.start_rpc_worker("127.0.0.1", port)
    assert manager.start_rpc_worker("127.0.0.1", port) is worker  # reuse, not a second one
    with pytest.raises(PortInUseError):
        RpcWorker(binaries, "127.0.0.1", port, log_dir=tmp_path).start()
    assert manager.stop_rpc_worker("127.0.0.1", port)
    assert not worker.alive


def test_model_file_missing_is_reported(manager: RuntimeManager, tmp_path: Path) -> None:
    with pytest.raises(RuntimeMissingError, match="model file not found"):
        manager.ensure_server(ServerSpec(str(tmp_path / "absent.gguf")))


def test_closed_manager_refuses_work(binaries: RuntimeBinaries, tmp_path: Path) -> None:
    mgr = RuntimeManager(binaries, tmp_path)
    mgr.close()
    with pytest.raises(LlamaRuntimeError):
        mgr.start_rpc_worker("127.0.0.1", free_loopback_port())


def test_children_die_with_a_killed_agent(binaries: RuntimeBinaries, tmp_path: Path) -> None:
    port = free_loopback_port()
    script = textwrap.dedent(
        f"""
        import json, threading, time
        from agent.runtime.llama_binaries import find_binaries
        from agent.runtime.runtime import RuntimeManager

        mgr = RuntimeManager(find_binaries({str(binaries.bin_dir)!r}), {str(tmp_path)!r})
        workers = []
        # Started from a thread that exits at once: PR_SET_PDEATHSIG is tied to the forking
        # thread, so the runtime must not let the child die with this thread.
        starter = threading.Thread(target=lambda: workers.append(mgr.start_rpc_worker(
            "127.0.0.1", {port})))
        starter.start()
        starter.join()
        print(json.dumps({{"pid": workers[0].pid}}), flush=True)
        time.sleep(60)
        """
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert agent.stdout is not None
        child_pid = json.loads(agent.stdout.readline())["pid"]
        assert psutil.pid_exists(child_pid)
        time.sleep(0.5)  # the starter thread is gone; the child must have survived that
        child = psutil.Process(child_pid)  # held before the kill: the child may die at once
        assert child.status() not in {psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}
        agent.kill()  # SIGKILL: no atexit, no cleanup in the agent
        agent.wait(timeout=10)
        gone, _ = psutil.wait_procs([child], timeout=10)
        assert gone, "ggml-rpc-server outlived the killed agent"
    finally:
        if agent.poll() is None:
            agent.kill()
        if agent.stdout is not None:
            agent.stdout.close()


def test_event_loop_is_not_blocked_while_streaming(
    manager: RuntimeManager, model_file: Path
) -> None:
    server = manager.ensure_server(ServerSpec(str(model_file), ctx_size=512))

    async def run() -> int:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        await collect(server, ChatRequest(messages=PROMPT, max_tokens=24, temperature=0.0))
        done.set()
        await task
        return ticks

    assert asyncio.run(run()) > 10
