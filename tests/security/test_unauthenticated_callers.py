"""What a caller without credentials can cost the controller (issue 21, findings 5 and 8).

* An enrollment with a bad token records what the caller sent in ``ACCESS_REFUSED``: a node
  name is checked (length, characters) before anything is recorded, and what is recorded is a
  short, printable form of it. A 10 MiB name with a NUL once broke the Postgres read model
  (``/health`` answered 503 until the event was skipped).
* ``Connect`` attempts without a valid credential are answered quickly, from memory, with
  ``UNAUTHENTICATED`` (or ``RESOURCE_EXHAUSTED`` when too many are under way), however many
  there are and whatever their first message holds, while an enrolled node keeps working.
* The unauthenticated ``/metrics`` names no node; the per-node view needs the admin key.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from application.enrollment import STORE_READS
from interfaces.controller_main import RunningController
from interfaces.grpc.grpc_server import HELLO_TIMEOUT_SECONDS, PENDING_PER_SOURCE
from tests.integration.control_client import ControlTarget, control_target, enroll
from tests.integration.fake_agent import FakeAgent
from tests.security.conftest import controller_in
from tests.security.controller_process import (
    ADMIN,
    MIB,
    answered,
    controller_process,
    https,
    peak_rss,
    rss,
    serving_agent,
    target,
)
from tests.security.netns import Namespace
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

#: Concurrent Connect attempts with made-up credentials, by what they send first.
SMALL_HELLO, BIG_HELLO, SILENT = 150, 30, 20
BIG = 8 * MIB
#: How long any of them may wait for its answer (s): its turn, then its Hello, then the check.
ANSWER_WITHIN = 2 * HELLO_TIMEOUT_SECONDS + 2.0
#: What the crowd may add to the controller's peak RSS: the big first messages it reads at
#: once (a few copies of each on the way through gRPC and protobuf), and some slack; and to
#: its threads: the store reads for node ids it does not know, and some slack.
RSS_GROWTH_BOUND = PENDING_PER_SOURCE * BIG * 4 + 64 * MIB
THREAD_GROWTH_BOUND = STORE_READS + 3


def _http(ctl: RunningController) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=10)


async def test_a_huge_name_with_a_nul_is_refused_and_recorded_in_a_safe_form(
    ctl: RunningController,
) -> None:
    name = "evil\x00" + "n" * (10 * MIB)
    before = ctl.services.app.position()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await enroll(control_target(ctl), "dacp1.forged.token", name)
    async with _http(ctl) as client:
        # The refusal is recorded and reaches the views (or breaks them).
        deadline = time.monotonic() + 10
        while ctl.services.app.position() == before or (
            ctl.services.follower.position < ctl.services.app.position()
            and not ctl.services.follower.error
        ):
            assert time.monotonic() < deadline, "the refusal was not recorded"
            await asyncio.sleep(0.05)
        health = await client.get("/health")
        assert health.status_code == 200, health.text
        rows = (await client.get("/api/admin/access-refusals", headers=ADMIN)).json()["data"]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "node_name" in (refused.value.details() or "")
    assert len(refused.value.details() or "") < 400
    [row] = rows
    recorded = str(row["node_name"])
    assert recorded.startswith("evil\\x00nnn") and "\x00" not in recorded
    assert len(recorded) < 200 and len(str(row["reason"])) < 1000


async def test_metrics_without_a_key_name_no_node(ctl: RunningController) -> None:
    agent = await FakeAgent(control_target(ctl), _token(ctl), "secret-name").start()
    try:
        async with _http(ctl) as client:
            deadline = time.monotonic() + 10
            while not ctl.services.connections.is_connected(agent.node_id):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            public = (await client.get("/metrics")).text
            assert "dacp_nodes{" in public  # the counts are there
            assert agent.node_id not in public and "secret-name" not in public
            assert (await client.get("/metrics/nodes")).status_code == 401
            detailed = await client.get("/metrics/nodes", headers=ADMIN)
            assert detailed.status_code == 200, detailed.text
            assert detailed.headers["content-type"].startswith("text/plain")
            connected = f'dacp_node_connected{{name="secret-name",node_id="{agent.node_id}"}} 1.0'
            assert connected in detailed.text
    finally:
        await agent.stop()


def _token(ctl: RunningController) -> str:
    return ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=False, node_name=None, now=time.time()
    ).token


async def _attempt(
    where: ControlTarget, node_id: str, first: pb.AgentMessage | None
) -> tuple[grpc.StatusCode | None, float]:
    """One Connect with a made-up credential: its final status and how long it took."""
    started = time.monotonic()
    never = asyncio.Event()

    async def requests() -> AsyncIterator[pb.AgentMessage]:
        if first is not None:
            yield first
        await never.wait()

    async with where.channel() as channel:
        stub = pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
        metadata = (("x-node-id", node_id), ("x-node-credential", "a-made-up-credential"))
        call = stub.Connect(requests(), metadata=metadata)
        try:
            async with asyncio.timeout(30):
                while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    pass
        except (grpc.aio.AioRpcError, TimeoutError):
            pass
        call.cancel()
        code = await call.code() if call.done() else None
    return code, time.monotonic() - started


async def test_a_crowd_of_unauthenticated_connects_is_answered_quickly_and_cheaply(
    namespace: Namespace, tmp_path: Path
) -> None:
    with controller_in(namespace, tmp_path) as env:
        proc = controller_process(env)
        healthy = await serving_agent(env, namespace)
        where = target(env)
        small = pb.AgentMessage(hello=pb.Hello(agent_version="x"))
        big = pb.AgentMessage(hello=pb.Hello(agent_version="x", csr_pem="c" * BIG))
        async with https(env) as client:
            assert await answered(client) == "Hello world"
            threads, before = proc.num_threads(), rss(proc)
            most_threads = threads
            attempts = [
                # Half with the real node's id (an attacker who learnt it), half made up.
                *(
                    _attempt(where, healthy.node_id if i % 2 else str(uuid.uuid4()), small)
                    for i in range(SMALL_HELLO)
                ),
                *(_attempt(where, healthy.node_id, big) for _ in range(BIG_HELLO)),
                *(_attempt(where, healthy.node_id, None) for _ in range(SILENT)),
            ]
            crowd = asyncio.gather(*attempts)
            answers = []
            while not crowd.done():
                answers.append(await answered(client))
                most_threads = max(most_threads, proc.num_threads())
            results = await crowd
            peak = peak_rss(proc)
            answers.append(await answered(client))
        await healthy.stop()
    kinds = ["small"] * SMALL_HELLO + ["big"] * BIG_HELLO + ["silent"] * SILENT
    codes: dict[str, int] = {}
    for kind, (code, _) in zip(kinds, results, strict=True):
        key = f"{kind}:{code.name if code else None}"
        codes[key] = codes.get(key, 0) + 1
    slowest = max(took for _, took in results)
    print(
        f"{len(results)} unauthenticated Connects: {codes}, slowest {slowest:.1f} s; controller "
        f"RSS {before / MIB:.0f} MiB before, peak {peak / MIB:.0f} MiB; threads {threads} "
        f"before, {most_threads} at most; {len(answers)} completions meanwhile"
    )
    assert set(answers) == {"Hello world"}
    allowed = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert {code for code, _ in results} <= allowed, codes
    assert slowest < ANSWER_WITHIN
    assert peak - before < RSS_GROWTH_BOUND, f"{before / MIB:.0f} -> {peak / MIB:.0f} MiB"
    assert most_threads - threads <= THREAD_GROWTH_BOUND
