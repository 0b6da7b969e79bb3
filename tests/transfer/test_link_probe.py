"""Link probes between nodes: node A's file server answers ``GET /probe/<n>`` with ``n`` zero
bytes to node B, whose ticket names ``PROBE_SUBJECT`` (common/model_file_server.py), and B
measures its link to A with it (agent/models/link_probe.py). The same real node A (a
ModelFileServer over TLS on loopback) and CA as the other transfer tests."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from agent.models.fetch_limits import FetchLimits, Watchdog
from agent.models.fetch_sources import connect_node
from agent.models.link_probe import ProbeError, download_mbps, measure_link, probe_size
from agent.models.model_fetch import TransferError, fetch
from agent.models.model_transfers import ModelTransfers
from common.link_probe import DEFAULT_PROBE_BYTES, MAX_PROBE_BYTES, PROBE_PATH, PROBE_SUBJECT
from tests.integration.fake_control_plane import free_port
from tests.transfer import test_model_transfer as base
from tests.transfer.test_model_transfer import SIZE, Pair
from wire import control_pb2 as pb

#: The fixture of the other transfer tests: node A serving a model, B's identity.
pair = base.pair

PROBE = 3 << 20


def _peer(pair: Pair, ticket: str | None = None, port: int | None = None) -> pb.LinkPeer:
    """Node A as B's peer, with a probe ticket for B unless ``ticket`` says otherwise."""
    return pb.LinkPeer(
        node_id=pair.a,
        host="127.0.0.1",
        port=pair.server.port if port is None else port,
        ticket=pair.ticket(sha=PROBE_SUBJECT) if ticket is None else ticket,
    )


def _get(pair: Pair, path: str, ticket: str) -> tuple[int, str | None, bytes]:
    """B's request for ``path`` on A's server: the status, Content-Length and body."""
    watch = Watchdog(FetchLimits())
    connection = connect_node(
        "127.0.0.1", pair.server.port, pair.a, pair.b_tls.client_context(pair.ca_pem), 10, watch
    )
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {ticket}"})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Length"), response.read()
    finally:
        watch.stop()
        connection.close()


def _refusal(pair: Pair, size: int, ticket: str | None = None) -> str:
    with pytest.raises(ProbeError) as refused:
        download_mbps(_peer(pair, ticket), size, pair.b_tls.client_context(pair.ca_pem))
    return str(refused.value)


def test_a_probe_with_its_ticket_gets_the_bytes_asked_for(pair: Pair) -> None:
    status, length, body = _get(pair, f"{PROBE_PATH}{PROBE}", pair.ticket(sha=PROBE_SUBJECT))
    assert (status, length) == (200, str(PROBE))
    assert body == bytes(PROBE)
    assert pair.server.bytes_sent == 0  # a probe is no model transfer


def test_a_models_ticket_is_refused_for_a_probe_and_a_probe_ticket_for_a_model(
    pair: Pair, tmp_path: Path
) -> None:
    assert "403" in _refusal(pair, PROBE, ticket=pair.ticket())
    assert "another model or node" in _refusal(pair, PROBE, ticket=pair.ticket())
    probe_ticket = pair.ticket(sha=PROBE_SUBJECT)
    with pytest.raises(TransferError, match="another model or node"):
        fetch(
            pair.source(probe_ticket),
            pair.sha256,
            SIZE,
            tmp_path / "b-models" / "model.gguf",
            pair.b_tls.client_context(pair.ca_pem),
        )
    assert pair.server.bytes_sent == 0


def test_a_probe_ticket_for_another_node_is_refused(pair: Pair) -> None:
    other = pair.ticket(node=str(uuid.uuid4()), sha=PROBE_SUBJECT)
    assert "another model or node" in _refusal(pair, PROBE, ticket=other)


@pytest.mark.parametrize("size", [0, MAX_PROBE_BYTES + 1])
def test_a_probe_of_no_bytes_or_beyond_the_most_is_a_bad_request(pair: Pair, size: int) -> None:
    refusal = _refusal(pair, size)
    assert "400" in refusal and f"1 to {MAX_PROBE_BYTES} bytes" in refusal


def test_a_probe_size_that_is_not_a_number_is_a_bad_request(pair: Pair) -> None:
    status, _, body = _get(pair, f"{PROBE_PATH}lots", pair.ticket(sha=PROBE_SUBJECT))
    assert status == 400 and b"/probe/<bytes>" in body


def test_a_revoked_node_is_refused_a_probe_despite_its_ticket(pair: Pair) -> None:
    pair.server.revoke([pair.b])
    refusal = _refusal(pair, PROBE)
    assert "403" in refusal and f"node {pair.b} has been revoked" in refusal


def test_a_link_is_measured_round_trip_and_bandwidth(pair: Pair) -> None:
    measure = measure_link(_peer(pair), PROBE, pair.b_tls.client_context(pair.ca_pem))
    assert measure.error == ""
    assert measure.node_id == pair.a
    assert measure.rtt_ms > 0 and measure.mbps > 0


def test_an_unreachable_peer_gives_an_error_and_zeros(pair: Pair) -> None:
    port = free_port()
    measure = measure_link(_peer(pair, port=port), PROBE, pair.b_tls.client_context(pair.ca_pem))
    assert measure.error.startswith(f"connect to 127.0.0.1:{port} failed")
    assert "refused" in measure.error.lower() and "\n" not in measure.error
    assert (measure.rtt_ms, measure.mbps) == (0, 0)


def test_a_refused_probe_gives_the_servers_reason_and_zeros(pair: Pair) -> None:
    measure = measure_link(
        _peer(pair, ticket=pair.ticket()), PROBE, pair.b_tls.client_context(pair.ca_pem)
    )
    assert "refused the probe (403" in measure.error
    assert (measure.rtt_ms, measure.mbps) == (0, 0)


def test_the_probe_size_defaults_and_is_clamped() -> None:
    assert probe_size(0) == DEFAULT_PROBE_BYTES
    assert probe_size(MAX_PROBE_BYTES + 1) == MAX_PROBE_BYTES
    assert probe_size(PROBE) == PROBE


async def test_the_agent_answers_probe_links_with_one_report_in_the_peers_order(
    pair: Pair, tmp_path: Path
) -> None:
    # The node's own transfers, with B's certificate (its data directory).
    transfers = ModelTransfers(
        tmp_path / "b-models", tmp_path / pair.b, "127.0.0.1", 0, on_model_added=lambda: None
    )
    transfers.ca_pem = pair.ca_pem
    gone = free_port()
    msg = pb.ProbeLinks(
        probe_id="p1", peers=[_peer(pair, port=gone), _peer(pair)], probe_bytes=PROBE
    )
    sent: list[pb.AgentMessage] = []

    async def send(message: pb.AgentMessage) -> None:
        sent.append(message)

    await transfers.on_probe_links(msg, send)
    assert [m.WhichOneof("payload") for m in sent] == ["link_report"]
    report = sent[0].link_report
    assert report.probe_id == "p1"
    assert [link.node_id for link in report.links] == [pair.a, pair.a]
    unreachable, reached = report.links
    assert f"127.0.0.1:{gone}" in unreachable.error and unreachable.mbps == 0
    assert reached.error == "" and reached.rtt_ms > 0 and reached.mbps > 0
