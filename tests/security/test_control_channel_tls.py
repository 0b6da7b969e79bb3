"""TLS on the control channel, on by default: the controller makes its own CA, every token
names it, an agent pins it with nothing copied by hand, a controller that shows another CA is
refused, and plaintext reaches nothing unless both ends ask for it."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from uuid import UUID

import grpc
import pytest

from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import NullHandler
from agent.control.controller_tls import TlsPinMismatch, token_ca_fingerprint
from agent.node.identity import load_identity
from application.enrollment import enrollment_key, mint_enrollment_token
from domain.catalog import code_of
from infrastructure.tls import fingerprint_of, load_or_create
from interfaces.controller_main import INSECURE_WARNING, RunningController, controller
from tests.conftest import controller_settings
from tests.integration.control_client import ControlTarget, control_target, enroll
from tests.integration.test_agent_with_controller import agent_config

pytestmark = pytest.mark.timeout(60)


def _agent(tmp_path: Path, ctl: RunningController, token: str) -> AgentSession:
    config = agent_config(
        tmp_path / "agent", ctl.grpc_port, token, name="pinned", backoff=(0.05, 0.2)
    )
    return AgentSession(config, NullHandler())


def _mint(ctl: RunningController) -> str:
    return ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token


async def test_an_agent_pins_the_ca_its_token_names_and_connects_over_tls(
    ctl: RunningController, tmp_path: Path
) -> None:
    tls = ctl.services.tls
    assert tls is not None
    token = _mint(ctl)
    assert token_ca_fingerprint(token) == tls.fingerprint
    session = _agent(tmp_path, ctl, token)
    task = asyncio.create_task(session.run())
    try:
        await session.wait_for_state(AgentState.READY, timeout=20)
        identity = load_identity(tmp_path / "agent")
        assert identity is not None
        assert fingerprint_of(identity.controller_ca_pem.encode()) == tls.fingerprint
        # A restart reconnects with the stored pin: no token, no second enrollment.
        await session.stop()
        await task
        again = _agent(tmp_path, ctl, "")
        task = asyncio.create_task(again.run())
        await again.wait_for_state(AgentState.READY, timeout=20)
        codes = [code_of(e) for e in ctl.services.app.events.get(UUID(str(again.node_id)))]
        assert codes.count("NODE_ENROLLED") == 1
        await again.stop()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_controller_that_shows_another_ca_is_refused(
    ctl: RunningController, tmp_path: Path
) -> None:
    """The token names a CA this controller does not have (a man in the middle, a wrong
    address): the agent stops with the TLS hint and enrolls nowhere."""
    other = load_or_create(tmp_path / "other-ca")
    token = mint_enrollment_token(
        enrollment_key("test-enrollment-secret"),
        ttl_seconds=60,
        single_use=True,
        node_name=None,
        now=time.time(),
        ca_fingerprint=other.fingerprint,
    ).token
    session = _agent(tmp_path, ctl, token)
    with pytest.raises(TlsPinMismatch, match="TLS settings"):
        await asyncio.wait_for(session.run(), 20)
    assert ctl.services.read_model.list_nodes() == []


async def test_plaintext_reaches_nothing_when_tls_is_on(ctl: RunningController) -> None:
    plaintext = ControlTarget(f"127.0.0.1:{ctl.grpc_port}")  # no CA: a plaintext channel
    token = _mint(ctl)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await enroll(plaintext, token, "sniffable")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ctl.services.read_model.list_nodes() == []
    enrolled = await enroll(control_target(ctl), token, "encrypted")  # the same token, TLS
    assert enrolled.node_id


async def test_plaintext_only_when_asked_and_then_with_a_warning(
    pg_schema: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="interfaces.controller_main")
    settings = controller_settings(pg_schema, tmp_path, insecure=True)
    async with controller(settings) as ctl:
        assert ctl.services.tls is None
        assert INSECURE_WARNING in caplog.text
        token = _mint(ctl)
        assert token_ca_fingerprint(token) is None  # nothing to pin
        enrolled = await enroll(ControlTarget(f"127.0.0.1:{ctl.grpc_port}"), token, "plain")
        assert enrolled.node_id
    assert not (tmp_path / "var" / "tls").exists()  # no CA made for nothing
