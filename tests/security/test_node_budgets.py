"""One enrolled node gets a bounded share of the controller (issue 21, finding 2).

A controller process serves in a network namespace of the test's own; one node enrolls and
floods its control stream with large bad messages, resource reports and faults while it never
reads what the controller sends back. The controller's memory (peak RSS, from /proc), its log
and what it records about the node stay within stated bounds, and another node goes on
answering chat completions through the OpenAI API meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

import pytest

from application.controller import Controller
from infrastructure.persistence import persistence_env
from tests.faults.waiting import until
from tests.integration.control_client import enroll, inventory
from tests.security.conftest import controller_in
from tests.security.controller_process import (
    MIB,
    answered,
    controller_log,
    controller_process,
    https,
    metric,
    peak_rss,
    rss,
    serving_agent,
    target,
    token,
)
from tests.security.netns import Namespace
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)

#: Bad messages of BIG bytes each (a token chunk without deltas, its job id all the bytes).
FLOOD = 120
BIG = 3 * MIB
#: Resource reports and fatal faults, each carrying LARGE bytes of text.
REPORTS = FAULTS = 20
LARGE = 2 * MIB
#: What the flood may add to the controller's peak RSS: the messages it is reading, not what
#: it would echo (before the fix: 360 MB of echoed job ids, queued for a node that never reads).
RSS_GROWTH_BOUND = 150 * MIB
#: What the flood may add to the controller's log, and to what it records about the node.
LOG_GROWTH_BOUND = 1 * MIB
RECORDED_BOUND = 256 * 1024


def _flood_messages(done: asyncio.Event) -> AsyncIterator[pb.AgentMessage]:
    async def messages() -> AsyncIterator[pb.AgentMessage]:
        yield pb.AgentMessage(hello=pb.Hello(agent_version="flood"))
        for i in range(REPORTS):
            inv = inventory()
            inv.hostname = f"{i:04d}" + "h" * LARGE  # a different report each time
            yield pb.AgentMessage(resource_report=pb.ResourceReport(inventory=inv))
        for i in range(FLOOD):
            chunk = pb.TokenChunk(job_id=f"{i:04d}" + "j" * BIG)  # no deltas: refused
            yield pb.AgentMessage(token_chunk=chunk)
        for i in range(FAULTS):
            fault = pb.RuntimeFault(message=f"{i:04d}" + "f" * LARGE, fatal=i % 2 == 0)
            yield pb.AgentMessage(runtime_fault=fault)
        done.set()
        await asyncio.Event().wait()  # the stream stays open; nothing is ever read

    return messages()


def _recorded_about(env: dict[str, str], node_id: str) -> tuple[int, int]:
    """(events, bytes) the controller's store holds about ``node_id``."""
    app = Controller(persistence_env(None, var_dir=Path(env["DACP_VAR_DIR"])))
    try:
        mine = [
            n
            for n in app.recorder.select_notifications(1, 100_000)
            if n.originator_id == UUID(node_id)
        ]
        return len(mine), sum(len(n.state) for n in mine)
    finally:
        app.close()


async def test_a_node_flooding_bad_messages_and_never_reading_costs_bounded_memory(
    namespace: Namespace, tmp_path: Path
) -> None:
    with controller_in(namespace, tmp_path) as env:
        proc = controller_process(env)
        healthy = await serving_agent(env, namespace)
        flooder = await enroll(target(env), token(env), "flooder", address=namespace.outside)
        log = controller_log(env)
        async with https(env) as client:
            assert await answered(client) == "Hello world"
            before, log_before = rss(proc), log.stat().st_size
            written = asyncio.Event()
            async with target(env).channel() as channel:
                stub = pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
                metadata = (
                    ("x-node-id", flooder.node_id),
                    ("x-node-credential", flooder.node_credential),
                )
                call = stub.Connect(_flood_messages(written), metadata=metadata)
                # The other node keeps answering while the flood goes in.
                answers = [await answered(client)]
                while not written.is_set():
                    answers.append(await answered(client))

                async def handled() -> bool:
                    text = (await client.get("/metrics")).text
                    refused = "dacp_agent_messages_rejected_total"
                    return metric(text, refused, kind="token_chunk") >= FLOOD

                deadline = asyncio.get_running_loop().time() + 60
                while not await handled():
                    assert asyncio.get_running_loop().time() < deadline, "flood not handled"
                    await asyncio.sleep(0.2)
                answers.append(await answered(client))
                peak = peak_rss(proc)
                call.cancel()
            with contextlib.suppress(Exception):
                await healthy.stop()
        log_growth = log.stat().st_size - log_before
        await until(lambda: _recorded_about(env, flooder.node_id)[0] > 0)
        events, recorded = _recorded_about(env, flooder.node_id)
    print(
        f"flood of {FLOOD} x {BIG // MIB} MiB: controller RSS {before / MIB:.0f} MiB before, "
        f"peak {peak / MIB:.0f} MiB; log +{log_growth / 1024:.0f} KiB; {events} events "
        f"({recorded / 1024:.0f} KiB) about the node; {len(answers)} completions meanwhile"
    )
    assert set(answers) == {"Hello world"}
    assert peak - before < RSS_GROWTH_BOUND, (
        f"the flood took the controller from {before / MIB:.0f} MiB to {peak / MIB:.0f} MiB"
    )
    assert log_growth < LOG_GROWTH_BOUND, f"the flood wrote {log_growth / MIB:.1f} MiB of log"
    assert recorded < RECORDED_BOUND, f"{events} events, {recorded / MIB:.1f} MiB, about the node"
