"""Model sources are not a way into a node's own machine (issue 21, finding 9): an http(s) URL
whose host is (or resolves to) a loopback, link-local, cloud metadata, unspecified or multicast
address is refused when it is registered (admin API 400, `dacp models source add` exit 2) and
again by the agent, after its own DNS resolution, before it connects, unless the operator
allows the network (MODEL_SOURCE_ALLOWED_CIDRS). Whatever a source answers, its error page
never comes back: a failure records the status code and a fixed description only. A real
controller and a real agent session over gRPC and TLS; the sources are http servers on
loopback."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest

from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import NullHandler
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.faults.streams import agent_holding_model
from tests.faults.waiting import until
from tests.security.conftest import dacp
from tests.transfer.http_sources import ERROR, SECRET, SERVE, http_source

ADMIN = {"Authorization": "Bearer test-admin-key"}
DATA = os.urandom(256 << 10)
SHA = hashlib.sha256(DATA).hexdigest()

pytestmark = pytest.mark.timeout(90)

REFUSED = [
    "http://127.0.0.1:8080/m.gguf",
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://localhost:9000/m.gguf",  # resolves to loopback
    "http://[::1]:8080/m.gguf",
    "http://[fe80::1]/m.gguf",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://[::ffff:127.0.0.1]/m.gguf",
    "http://0.0.0.0:8080/m.gguf",
    "http://224.0.0.1/m.gguf",
    "http://metadata.google.internal/computeMetadata/v1/",
    "https://2130706433/m.gguf",  # 127.0.0.1 written as one number
]


@pytest.fixture
async def ctl_loopback(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    """A controller whose operator allows model sources on loopback."""
    settings = controller_settings(pg_schema, tmp_path, model_source_allowed_cidrs=("127.0.0.0/8",))
    async with controller(settings) as running:
        yield running


def _client(ctl: RunningController) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=10)


async def _agent(ctl: RunningController, tmp_path: Path) -> tuple[AgentSession, asyncio.Task[Any]]:
    session = agent_holding_model(ctl, tmp_path, NullHandler(), name="victim")
    run = asyncio.create_task(session.run())
    await session.wait_for_state(AgentState.READY, timeout=20)
    return session, run


async def _stop(session: AgentSession, run: asyncio.Task[Any]) -> None:
    await session.stop()
    await asyncio.gather(run, return_exceptions=True)


def _failed(ctl: RunningController) -> bool:
    """Whether the victim's row records a failed transfer (what the admin API shows)."""
    return any(
        n["name"] == "victim" and n.get("transfer_failures")
        for n in ctl.services.read_model.list_nodes()
    )


async def _failures(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    nodes = (await http.get("/api/admin/nodes", headers=ADMIN)).json()["data"]
    (victim,) = [n for n in nodes if n["name"] == "victim"]
    return list(victim["transfer_failures"])


async def _pull(http: httpx.AsyncClient) -> None:
    """Asks for model x on the victim node (accepted, to run in the background)."""
    r = await http.post(
        "/api/admin/models/pull", headers=ADMIN, json={"model": "x", "nodes": ["victim"]}
    )
    assert r.status_code == 202, r.text


def _recorded(ctl: RunningController, session: AgentSession) -> str:
    """Everything recorded about the victim node (its events, as the timeline reads them)."""
    return repr(list(ctl.services.app.events.get(UUID(str(session.node_id)))))


async def test_sources_on_loopback_link_local_and_metadata_are_refused(
    ctl: RunningController, pg_schema: str
) -> None:
    ctl.services.app.register_model("x", SHA, "x.gguf", 2048)
    async with _client(ctl) as http:
        for url in REFUSED:
            r = await http.post(
                "/api/admin/models/sources", headers=ADMIN, json={"model": "x", "url": url}
            )
            assert r.status_code == 400, (url, r.status_code, r.text)
            error = r.json()["error"]
            assert error["code"] == "source_refused" and error["param"] == "url", error
            assert "MODEL_SOURCE_ALLOWED_CIDRS" in error["message"], error
        lan = "http://10.0.0.9:8080/models/x.gguf"  # the operator's network: fine
        r = await http.post(
            "/api/admin/models/sources", headers=ADMIN, json={"model": "x", "url": lan}
        )
        assert r.status_code == 201, r.text
        rows = (await http.get("/api/admin/models", headers=ADMIN)).json()["data"]
        assert next(m for m in rows if m["name"] == "x")["sources"] == [lan]

    # `dacp models source add` writes to the store itself: the same check, one line, exit 2.
    cli = await dacp(pg_schema, "models", "source", "add", "--store", "x", "http://127.0.0.1:6379/")
    assert cli.returncode == 2, (cli.stdout, cli.stderr)
    assert "loopback" in cli.stderr and "MODEL_SOURCE_ALLOWED_CIDRS" in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    allowed = await dacp(
        pg_schema,
        "models",
        "source",
        "add",
        "--store",
        "x",
        "http://127.0.0.1:6379/",
        MODEL_SOURCE_ALLOWED_CIDRS="127.0.0.1/32",
    )
    assert allowed.returncode == 0, allowed.stderr


async def test_an_agent_refuses_a_loopback_source_recorded_before_and_reads_nothing(
    ctl: RunningController, tmp_path: Path
) -> None:
    session, run = await _agent(ctl, tmp_path)
    try:
        with http_source(DATA, ERROR) as source:
            ctl.services.app.register_model("x", SHA, "x.gguf", 2048)
            # Recorded straight into the store (before this check existed, say).
            ctl.services.app.add_model_source("x", source.url)
            async with _client(ctl) as http:
                await _pull(http)
                await until(lambda: _failed(ctl), 20)
                (failure,) = await _failures(http)
            assert source.requests == 0, "the agent connected to a loopback source"
            assert "loopback" in failure["error"], failure
            assert SECRET not in str(failure) and SECRET not in _recorded(ctl, session)
    finally:
        await _stop(session, run)


async def test_an_error_page_never_comes_back_and_an_allowed_loopback_source_works(
    ctl_loopback: RunningController, tmp_path: Path
) -> None:
    ctl = ctl_loopback
    session, run = await _agent(ctl, tmp_path)
    try:
        with http_source(DATA, ERROR) as source:
            ctl.services.app.register_model("x", SHA, "x.gguf", 2048)
            async with _client(ctl) as http:
                r = await http.post(
                    "/api/admin/models/sources",
                    headers=ADMIN,
                    json={"model": "x", "url": source.url},
                )
                assert r.status_code == 201, r.text  # loopback is allowed here
                await _pull(http)
                await until(lambda: _failed(ctl), 20)
                (failure,) = await _failures(http)
                assert source.requests == 1
                assert "500" in failure["error"], failure
                nodes = (await http.get("/api/admin/nodes", headers=ADMIN)).text
                assert SECRET not in nodes and "internal error" not in nodes
                assert SECRET not in _recorded(ctl, session)

                # The same source, now serving the file: the allowed loopback source works.
                source.mode = SERVE
                await _pull(http)
                fetched = tmp_path / "models" / "x.gguf"
                await until(fetched.exists, 20)
        assert fetched.read_bytes() == DATA
    finally:
        await _stop(session, run)
