"""``ProbeLinks`` reaches the node's transfers through the session's job traffic and is
answered by one ``LinkReport`` on the stream: here on a node with no certificate yet, whose
every peer is reported unmeasured (the measures themselves: tests/transfer/test_link_probe.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import grpc.aio

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession
from agent.control.control_handler import NullHandler
from agent.control.job_traffic import Connection
from agent.models.link_probe import NO_CERTIFICATE
from wire import control_pb2 as pb

Call = grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControllerMessage]


async def test_probe_links_is_answered_by_one_link_report_with_its_probe_id(
    tmp_path: Path,
) -> None:
    session = AgentSession(AgentConfig(data_dir=tmp_path, node_name="n"), NullHandler())
    conn = Connection(cast(Call, object()))
    session.traffic.conn = conn
    peers = [pb.LinkPeer(node_id=node, host="127.0.0.1", port=1, ticket="t") for node in ("a", "b")]
    probe = pb.ProbeLinks(probe_id="probe-7", peers=peers, probe_bytes=1 << 20)
    session.traffic.dispatch(pb.ControllerMessage(probe_links=probe))
    answer = await asyncio.wait_for(conn.queue.get(), 10)
    await asyncio.gather(*session.traffic.tasks)
    assert conn.queue.empty()  # one report for the whole probe
    report = answer.link_report
    assert answer.WhichOneof("payload") == "link_report" and report.probe_id == "probe-7"
    assert [(m.node_id, m.error, m.rtt_ms, m.mbps) for m in report.links] == [
        ("a", NO_CERTIFICATE, 0, 0),
        ("b", NO_CERTIFICATE, 0, 0),
    ]
