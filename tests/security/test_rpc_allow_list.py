"""Who may still reach a node's RPC worker once its primary changed or was revoked (issue 21,
finding 4): a real controller, a real agent session running the real ``ggml-rpc-server``
through its llama.cpp handler, and primaries in network namespaces of the test's own that
speak the RPC protocol's HELLO (tests/security/test_rpc_guard.py).

* A worker used by primary A, then by primary B, no longer lets A in: neither a new connection
  nor the one A still holds (each ``StartRpcWorker`` carries the exact set, which replaces the
  old one). Both gates: the accept filter in the worker and the copying guard.
* A revoked primary is cut off at once: the controller's ``NodesRevoked`` closes its open
  connection and refuses its next one, while its job would still have been running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import Send
from agent.runtime.llama_binaries import find_binaries
from agent.runtime.llama_handler import LlamaHandler
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.faults.services import free_port
from tests.faults.waiting import until
from tests.integration.control_client import control_target, enroll
from tests.security.netns import Namespace, namespace_fixture
from tests.security.test_rpc_guard import HELLO_ANSWER_BYTES, _hello_from
from wire import control_pb2 as pb

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": "Bearer test-admin-key"}

#: From inside a namespace: one connection that says HELLO (prints the answer's size), waits
#: for a line on stdin, then says whether the worker closed it within argv[3] seconds.
HELD_CLIENT = """
import socket, struct, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
def read(n):
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return got
s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
head = read(8)
size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
read(size)
print(size, flush=True)
sys.stdin.readline()
s.settimeout(float(sys.argv[3]))
try:
    print("closed" if not s.recv(1) else "data", flush=True)
except socket.timeout:
    print("open", flush=True)
except OSError:
    print("closed", flush=True)
"""


class HeldConnection:
    """A primary's open connection to the worker (its llama-server holds one so)."""

    def __init__(self, proc: asyncio.subprocess.Process, hello: int) -> None:
        self.proc, self.hello = proc, hello

    @classmethod
    async def open(cls, ns: Namespace, host: str, port: int, wait: float) -> HeldConnection:
        proc = await asyncio.create_subprocess_exec(
            *ns.command(sys.executable, "-c", HELD_CLIENT, host, str(port), str(wait)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        return cls(proc, int(line.strip() or 0))

    async def still_open(self) -> bool:
        """Whether the worker kept this connection (waits up to its ``wait`` for a close)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()
        verdict = (await asyncio.wait_for(self.proc.stdout.readline(), 30)).decode().strip()
        await self.proc.wait()
        return verdict == "open"

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


class WorkerNode(LlamaHandler):
    """The real handler; counts the RPC worker messages it has fully handled."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.starts: list[pb.RpcWorkerStatus] = []

    async def on_start_rpc_worker(self, msg: pb.StartRpcWorker, send: Send) -> None:
        async def recorded(message: pb.AgentMessage) -> None:
            self.starts.append(message.rpc_worker_status)
            await send(message)

        await super().on_start_rpc_worker(msg, recorded)


ns_a = namespace_fixture(74)


ns_b = namespace_fixture(75)


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    # Primaries enroll from loopback with their namespace's address: NAT, as far as the
    # controller can tell.
    settings = controller_settings(pg_schema, tmp_path, enroll_allow_nat=True)
    async with controller(settings) as running:
        yield running


@dataclasses.dataclass
class Worker:
    ctl: RunningController
    handler: WorkerNode
    session: AgentSession
    node_id: str
    host: str
    port: int

    async def start_for(self, job_id: str, *primaries: tuple[str, str]) -> None:
        """The controller sends ``StartRpcWorker`` for ``job_id`` naming ``primaries``
        ((node id, address) each), as its job manager does; returns once it is answered."""
        started = len(self.handler.starts)
        message = pb.StartRpcWorker(
            job_id=job_id,
            host=self.host,
            port=self.port,
            allowed_peers=[address for _, address in primaries],
            peers=[pb.RpcPeerAccess(node_id=n, address=a) for n, a in primaries],
        )
        sent = self.ctl.services.connections.send(
            self.node_id, pb.ControllerMessage(start_rpc_worker=message)
        )
        assert sent
        await until(lambda: len(self.handler.starts) > started, 30)
        status = self.handler.starts[-1]
        assert status.state == pb.RpcWorkerStatus.STARTED, status.error


async def _worker(
    ctl: RunningController, tmp_path: Path, host: str, *, accept_filter: bool
) -> Worker:
    binaries = find_binaries()
    assert binaries.accept_filter is not None, "ops.build_llama builds the filter here"
    if not accept_filter:
        binaries = dataclasses.replace(binaries, accept_filter=None)
    handler = WorkerNode(
        binaries,
        models_dir=tmp_path / "models",
        data_dir=tmp_path / "agent",
        log_dir=tmp_path / "logs",
        rpc_threads=1,
    )
    token = ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token
    config = AgentConfig(
        data_dir=tmp_path / "agent",
        models_dir=tmp_path / "models",
        node_name="worker",
        controller_url=f"127.0.0.1:{ctl.grpc_port}",
        enrollment_token=token,
        advertise_address="127.0.0.1",
        heartbeat_interval=0.2,
        backoff_initial=0.05,
        backoff_max=0.5,
    )
    session = AgentSession(config, handler)
    return Worker(ctl, handler, session, "", host, free_port())


def _listening(worker: Worker) -> bool:
    rpc = worker.handler.rpc_worker
    return rpc is not None and rpc.alive and rpc._listening()


async def _running(worker: Worker) -> asyncio.Task[None]:
    task = asyncio.create_task(worker.session.run())
    await worker.session.wait_for_state(AgentState.READY, timeout=30)
    worker.node_id = str(worker.session.node_id)
    return task


async def _stop(worker: Worker, task: asyncio.Task[None]) -> None:
    await worker.session.stop()
    await asyncio.gather(task, return_exceptions=True)
    await worker.handler.close()


@pytest.mark.parametrize("accept_filter", [True, False], ids=["accept-filter", "copying-guard"])
async def test_a_worker_taken_over_by_primary_b_no_longer_lets_primary_a_in(
    ctl: RunningController, tmp_path: Path, ns_a: Namespace, ns_b: Namespace, accept_filter: bool
) -> None:
    # The worker listens on its address towards A; B's namespace routes there as well.
    worker = await _worker(ctl, tmp_path, ns_a.outside, accept_filter=accept_filter)
    task = await _running(worker)
    held: HeldConnection | None = None
    try:
        await worker.start_for("job-a", ("node-a", ns_a.inside))
        held = await HeldConnection.open(ns_a, worker.host, worker.port, wait=3.0)
        assert held.hello == HELLO_ANSWER_BYTES  # A's llama-server is linked to the worker

        # A's job ended; B's job takes the worker (a new runtime: another primary).
        await worker.start_for("job-b", ("node-b", ns_b.inside))
        assert not await held.still_open(), "A's open connection survived B taking the worker"
        assert await _hello_from(ns_b, worker.host, worker.port) == HELLO_ANSWER_BYTES
        assert await _hello_from(ns_a, worker.host, worker.port) == 0, "A is still let in"
    finally:
        if held is not None:
            await held.close()
        await _stop(worker, task)


async def test_a_revoked_primary_is_cut_off_at_once(
    ctl: RunningController, tmp_path: Path, ns_a: Namespace
) -> None:
    target = control_target(ctl)
    token = ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token
    primary = await enroll(target, token, "primary-a", address=ns_a.inside)
    worker = await _worker(ctl, tmp_path, ns_a.outside, accept_filter=True)
    task = await _running(worker)
    held: HeldConnection | None = None
    try:
        await worker.start_for("job-a", (primary.node_id, ns_a.inside))
        held = await HeldConnection.open(ns_a, worker.host, worker.port, wait=5.0)
        assert held.hello == HELLO_ANSWER_BYTES

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as http:
            r = await http.post(
                f"/api/admin/nodes/{primary.node_id}/revoke",
                headers=ADMIN,
                json={"reason": "laptop stolen"},
            )
            assert r.status_code == 200, r.text
        revoked_at = time.monotonic()
        assert not await held.still_open(), "the revoked primary kept its connection"
        print(f"revoked primary cut off {time.monotonic() - revoked_at:.2f}s after the revocation")
        # The worker is restarted to cut A's connection; once it listens again, A is refused.
        await until(lambda: _listening(worker), 30)
        assert await _hello_from(ns_a, worker.host, worker.port) == 0, "revoked A is let in"
    finally:
        if held is not None:
            await held.close()
        await _stop(worker, task)
