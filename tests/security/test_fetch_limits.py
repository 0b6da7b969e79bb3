"""A source cannot hold a fetch (issue 21, finding 3): a source that trickles bytes, one that
is steady but would take longer than the deadline, and one that announces another size than
the model's are each given up within the stated bound, and the fetch moves on to the next
source, which succeeds.

First through the whole path (a real controller, a real agent session over gRPC and TLS, the
model's http sources on loopback, which this controller allows); then a node's fetch from
peers over TLS, where the peers that lie hold real node certificates from the controller's CA.
The limits are small (a 1 s rate window, a 3 s deadline) so that the test takes seconds."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

import httpx
import pytest

from agent.control.control_client import AgentState
from agent.control.control_handler import NullHandler
from agent.models.fetch_limits import FetchLimits
from agent.models.model_transfers import ModelTransfers
from agent.node.node_tls import NodeTls
from common.model_file_server import ModelFileServer
from common.transfer_ticket import Ticket, sign_ticket
from domain.node import Node
from infrastructure.tls import issue_node_cert, load_or_create
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.faults.streams import agent_holding_model
from tests.faults.waiting import until
from tests.transfer.http_sources import SERVE, SLOW, TRICKLE, WRONG_SIZE, http_source
from tests.unit.test_agent_model_store import write_tiny_gguf
from wire import control_pb2 as pb

ADMIN = {"Authorization": "Bearer test-admin-key"}
DATA = os.urandom(2 << 20)
SHA = hashlib.sha256(DATA).hexdigest()
#: What the agents here are configured with (--fetch-min-rate 64K --fetch-rate-window 1
#: --fetch-deadline 3).
LIMITS = FetchLimits(deadline=3.0, min_rate=64 << 10, rate_window=1.0)
#: The longest a source below the floor is kept: one window, and a quarter more for the
#: watchdog's next look.
RATE_BOUND = LIMITS.rate_window * 1.25

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def ctl_loopback(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    settings = controller_settings(pg_schema, tmp_path, model_source_allowed_cidrs=("127.0.0.0/8",))
    async with controller(settings) as running:
        yield running


async def test_a_trickling_source_is_given_up_for_the_next(
    ctl_loopback: RunningController, tmp_path: Path
) -> None:
    ctl = ctl_loopback
    write_tiny_gguf(tmp_path / "x.gguf", layers=6)  # another file than the one the agent holds
    data = (tmp_path / "x.gguf").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    session = agent_holding_model(ctl, tmp_path, NullHandler(), name="victim", fetch_limits=LIMITS)
    run = asyncio.create_task(session.run())
    try:
        await session.wait_for_state(AgentState.READY, timeout=20)
        with http_source(data, TRICKLE) as trickle, http_source(data, SERVE) as good:
            ctl.services.app.register_model("x", sha, "x.gguf", 2048)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=10
            ) as http:
                for url in (trickle.url, good.url):  # the trickling one is tried first
                    r = await http.post(
                        "/api/admin/models/sources",
                        headers=ADMIN,
                        json={"model": "x", "url": url},
                    )
                    assert r.status_code == 201, r.text
                started = time.monotonic()
                r = await http.post(
                    "/api/admin/models/pull",
                    headers=ADMIN,
                    json={"model": "x", "nodes": ["victim"]},
                )
                assert r.status_code == 202, r.text
                assert r.json()["transfers"][0]["sources"] == [trickle.url, good.url]
                fetched = tmp_path / "models" / "x.gguf"
                await until(fetched.exists, 30)
                took = time.monotonic() - started
        assert fetched.read_bytes() == data
        assert trickle.requests == 1 and good.requests == 1
        assert took < RATE_BOUND + 3, f"the fetch took {took:.1f} s"

        def completed() -> list[Node.ModelTransferCompleted]:
            events = ctl.services.app.events.get(UUID(str(session.node_id)))
            return [e for e in events if isinstance(e, Node.ModelTransferCompleted)]

        await until(completed, 10)
        (done,) = completed()
        assert done.source_node_id == good.url
    finally:
        await session.stop()
        await asyncio.gather(run, return_exceptions=True)


def _identity(tmp: Path, ca_pem: bytes, ca_key: bytes, node_id: str) -> NodeTls:
    tls = NodeTls(tmp / node_id)
    tls.store(issue_node_cert(ca_pem, ca_key, node_id, tls.csr(node_id).encode()).decode())
    return tls


async def test_lying_and_slow_peers_are_given_up_for_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = load_or_create(tmp_path / "tls")
    assert ca.ca_key_pem is not None
    ca_pem, ca_key = ca.ca_pem, ca.ca_key_pem
    victim, good_id = str(uuid.uuid4()), str(uuid.uuid4())
    liars = {mode: str(uuid.uuid4()) for mode in (WRONG_SIZE, TRICKLE, SLOW)}
    held = tmp_path / "good" / "model.gguf"
    held.parent.mkdir()
    held.write_bytes(DATA)
    good = ModelFileServer(
        "127.0.0.1",
        0,
        _identity(tmp_path, ca_pem, ca_key, good_id).server_context(ca_pem.decode()),
        ca_pem.decode(),
        lambda sha: held if sha == SHA else None,
    ).start()
    transfers = ModelTransfers(
        tmp_path / "victim-models",
        tmp_path / "victim",
        "127.0.0.1",
        0,
        on_model_added=lambda: None,
        fetch_limits=LIMITS,
    )
    cert = issue_node_cert(ca_pem, ca_key, victim, transfers.csr(victim).encode()).decode()
    transfers.welcomed(cert, ca_pem.decode())
    # The file is random bytes (2 MiB, for the slow peer), not a GGUF its hash cache reads.
    monkeypatch.setattr(transfers.store, "remember", lambda path, sha: None)
    ticket = sign_ticket(ca_key, Ticket(SHA, victim, time.time() + 60))
    sent: list[pb.AgentMessage] = []

    async def send(message: pb.AgentMessage) -> None:
        sent.append(message)

    contexts = {
        mode: _identity(tmp_path, ca_pem, ca_key, node).server_context(ca_pem.decode())
        for mode, node in liars.items()
    }
    try:
        with (
            http_source(DATA, WRONG_SIZE, contexts[WRONG_SIZE]) as wrong,
            http_source(DATA, TRICKLE, contexts[TRICKLE]) as trickle,
            http_source(DATA, SLOW, contexts[SLOW]) as slow,
        ):
            sources = [
                pb.TransferSource(
                    node_id=liars[WRONG_SIZE], host="127.0.0.1", port=wrong.port, ticket=ticket
                ),
                pb.TransferSource(
                    node_id=liars[TRICKLE], host="127.0.0.1", port=trickle.port, ticket=ticket
                ),
                pb.TransferSource(
                    node_id=liars[SLOW], host="127.0.0.1", port=slow.port, ticket=ticket
                ),
                pb.TransferSource(node_id=good_id, host="127.0.0.1", port=good.port, ticket=ticket),
            ]
            request = pb.FetchModel(
                transfer_id="t-1",
                model_sha256=SHA,
                file_name="model.gguf",
                size_bytes=len(DATA),
                sources=sources,
            )
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="agent.models.model_transfers"):
                await asyncio.wait_for(transfers.on_fetch(request, send), 30)
            took = time.monotonic() - started
        states = [m.model_transfer.state for m in sent]
        assert states[0] == pb.ModelTransfer.STARTED and states[-1] == pb.ModelTransfer.COMPLETED
        assert sent[-1].model_transfer.source_node_id == good_id
        assert (tmp_path / "victim-models" / "model.gguf").read_bytes() == DATA
        assert wrong.requests == trickle.requests == slow.requests == 1
        given_up = "\n".join(r.getMessage() for r in caplog.records)
        assert f"announced model.gguf as {len(DATA) + (1 << 20)} bytes" in given_up, given_up
        assert "below the minimum" in given_up and "--fetch-min-rate" in given_up, given_up
        assert "had not finished within 3 s (--fetch-deadline)" in given_up, given_up
        # A wrong size costs nothing; a trickle one window; a slow one the deadline.
        bound = RATE_BOUND + LIMITS.deadline + 2
        assert took < bound, f"the fetch took {took:.1f} s (bound {bound:.1f} s)"
    finally:
        transfers.close()
        good.stop()
