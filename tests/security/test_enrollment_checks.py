"""Enrollment checks, across a network namespace the test creates: the controller listens on a
private address inside it and the agent side connects from this namespace's end of the veth.
An advertised address must be inside ALLOWED_PEER_CIDRS and be the address the agent connects
from (unless ENROLL_ALLOW_NAT); each refusal is audited (ACCESS_REFUSED, security
violation); tokens are single-use and live an hour unless asked otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from application.controller import Controller
from domain.catalog import code_of
from infrastructure.persistence import persistence_env
from tests.integration.control_client import ControlTarget, enroll
from tests.security.conftest import controller_in
from tests.security.controller_process import target as control_target_of
from tests.security.controller_process import token as token_for
from tests.security.netns import Namespace

pytestmark = pytest.mark.timeout(120)


def _refusals(env: dict[str, str]) -> list[Any]:
    """The ACCESS_REFUSED events in the controller's (SQLite) store."""
    app = Controller(persistence_env(None, var_dir=Path(env["DACP_VAR_DIR"])))
    try:
        events = [app.mapper.to_domain_event(n) for n in app.recorder.select_notifications(1, 1000)]
        return [e for e in events if code_of(e) == "ACCESS_REFUSED"]
    finally:
        app.close()


async def _refused(target: ControlTarget, token: str, name: str, address: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await enroll(target, token, name, address=address)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    return refused.value.details() or ""


async def test_the_advertised_address_must_be_private_and_the_one_it_comes_from(
    namespace: Namespace, tmp_path: Path
) -> None:
    with controller_in(namespace, tmp_path) as env:
        target, token = control_target_of(env), token_for(env, ttl_seconds=60)
        # From this namespace's end of the veth, advertising that very address: welcome.
        enrolled = await enroll(target, token, "honest", address=namespace.outside)
        assert enrolled.node_id
        # Another private address than the one it comes from: refused (no NAT allowed).
        mismatch = await _refused(target, token, "spoofer", "10.9.9.9")
        assert f"connects from ({namespace.outside})" in mismatch
        # A public address: refused.
        public = await _refused(target, token, "public", "203.0.113.9")
        assert "outside ALLOWED_PEER_CIDRS" in public
    [refusal] = _refusals(env)  # the second within 10 s from the same address: counted only
    assert (refusal.kind, refusal.node_name, refusal.source) == (
        "enroll",
        "spoofer",
        namespace.outside,
    )
    assert refusal.security_violation and "security violation" in refusal.reason


async def test_behind_nat_the_address_may_differ_but_must_still_be_private(
    namespace: Namespace, tmp_path: Path
) -> None:
    with controller_in(namespace, tmp_path, ENROLL_ALLOW_NAT="true") as env:
        target, token = control_target_of(env), token_for(env, ttl_seconds=60)
        assert (await enroll(target, token, "behind-nat", address="10.9.9.9")).node_id
        assert "ALLOWED_PEER_CIDRS" in await _refused(target, token, "public", "203.0.113.9")
