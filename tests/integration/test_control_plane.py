"""The control plane over real gRPC, real Postgres and real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import UUID

import grpc
import httpx
import pytest

from domain.catalog import code_of
from domain.enrollment_token import mint_token
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.integration.control_client import (
    ControlTarget,
    RawSession,
    control_target,
    enroll,
    inventory,
)
from tests.plans import one_node_plan
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

SECRET = "test-enrollment-secret"
ADMIN = {"Authorization": "Bearer test-admin-key"}


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    async with controller(controller_settings(pg_schema, tmp_path)) as running:
        yield running


@pytest.fixture
async def quiet_ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    """A controller whose health sweep stays quiet for the length of a test, for tests that
    assert that nothing at all was recorded."""
    settings = controller_settings(pg_schema, tmp_path, degraded_after=60.0, offline_after=120.0)
    async with controller(settings) as running:
        yield running


def target(ctl: RunningController) -> ControlTarget:
    return control_target(ctl)


def http(ctl: RunningController) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=10)


def token(**kw: Any) -> str:
    args: dict[str, Any] = {
        "secret": SECRET.encode(),
        "token_id": "t1",
        "expires_at": time.time() + 600,
        "single_use": False,
        "node_name": None,
    }
    args.update(kw)
    return mint_token(**args)


async def recorded_since(ctl: RunningController, position: int) -> list[Any]:
    """The events recorded after ``position`` (waiting briefly for audits written beside)."""
    app = ctl.services.app
    deadline = time.monotonic() + 5
    while app.position() == position and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # anything else that would follow
    return [
        app.mapper.to_domain_event(n) for n in app.recorder.select_notifications(position + 1, 1000)
    ]


def codes(ctl: RunningController, node_id: str) -> list[str]:
    return [code_of(e) for e in ctl.services.app.repository.event_store.get(UUID(node_id))]


async def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


async def connected_node(ctl: RunningController, name: str = "n1") -> tuple[str, RawSession]:
    enrolled = await enroll(target(ctl), token(), name)
    session = RawSession(target(ctl), enrolled.node_id, enrolled.node_credential)
    welcome = await session.open()
    assert welcome.WhichOneof("payload") == "welcome"
    session.start_heartbeats(0.2)
    return enrolled.node_id, session


async def ready_node(ctl: RunningController, name: str = "n1") -> tuple[str, RawSession]:
    """A :func:`connected_node` once the read model shows it READY."""
    node_id, session = await connected_node(ctl, name)
    read = ctl.services.read_model
    await wait_for(lambda: (read.get_node(node_id) or {}).get("state") == "READY")
    return node_id, session


async def test_enroll_records_node_with_inventory(ctl: RunningController) -> None:
    enrolled = await enroll(target(ctl), token(), "node-a")  # advertises where it comes from
    assert enrolled.node_credential and enrolled.controller_version
    node = ctl.services.app.get_node(enrolled.node_id)
    assert node.name == "node-a" and node.address == "127.0.0.1"
    assert node.inventory["ram_total_bytes"] == 8 << 30
    assert node.credential_sha256 != enrolled.node_credential  # only a hash is stored
    assert codes(ctl, enrolled.node_id) == ["NODE_ENROLLED"]


@pytest.mark.parametrize(
    ("bad", "status"),
    [
        ("garbage", grpc.StatusCode.UNAUTHENTICATED),
        ("forged", grpc.StatusCode.UNAUTHENTICATED),
        ("wrong-secret", grpc.StatusCode.UNAUTHENTICATED),
        ("expired", grpc.StatusCode.UNAUTHENTICATED),
        ("other-name", grpc.StatusCode.PERMISSION_DENIED),
        ("reused", grpc.StatusCode.ALREADY_EXISTS),
    ],
)
async def test_bad_tokens_refused_and_nothing_recorded(
    quiet_ctl: RunningController, bad: str, status: grpc.StatusCode
) -> None:
    ctl = quiet_ctl
    if bad == "garbage":
        tok = "not-a-token"
    elif bad == "forged":
        good = token()
        tok = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
    elif bad == "wrong-secret":
        tok = token(secret=b"another-secret")
    elif bad == "expired":
        tok = token(expires_at=time.time() - 1)
    elif bad == "other-name":
        tok = token(node_name="someone-else")
    else:
        tok = token(single_use=True, token_id="once")
        await enroll(target(ctl), tok, "first")
    before = ctl.services.app.position()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await enroll(target(ctl), tok, "n-bad")
    assert info.value.code() == status
    assert info.value.details()
    # No node, no redemption: only the audit of the refusal.
    [refused] = await recorded_since(ctl, before)
    assert code_of(refused) == "ACCESS_REFUSED" and refused.node_name == "n-bad"
    assert refused.kind == "enroll" and refused.source == "127.0.0.1"


async def test_connect_requires_own_credential(quiet_ctl: RunningController) -> None:
    ctl = quiet_ctl
    a = await enroll(target(ctl), token(), "a")
    b = await enroll(target(ctl), token(), "b")
    cases = [
        (RawSession(target(ctl), a.node_id, ""), grpc.StatusCode.UNAUTHENTICATED),
        (RawSession(target(ctl), a.node_id, b.node_credential), grpc.StatusCode.UNAUTHENTICATED),
        (RawSession(target(ctl), "no-such-node", "x"), grpc.StatusCode.UNAUTHENTICATED),
        (
            RawSession(target(ctl), a.node_id, a.node_credential, hello_id=b.node_id),
            grpc.StatusCode.PERMISSION_DENIED,
        ),
    ]
    before = ctl.services.app.position()
    for session, status in cases:
        with pytest.raises(grpc.aio.AioRpcError):
            await session.open()
        assert session.final_code == status, session.node_id
        await session.close()
    # Audited: the first refusal from this address; the rest within 10 s only counted.
    [refused] = await recorded_since(ctl, before)
    assert (code_of(refused), refused.kind, refused.node_id) == (
        "ACCESS_REFUSED",
        "connect",
        a.node_id,
    )
    assert codes(ctl, b.node_id) == ["NODE_ENROLLED"]


async def test_a_stream_without_a_hello_is_ended(quiet_ctl: RunningController) -> None:
    """The credential is judged once the Hello is in: a caller that never sends one is not
    left holding a stream."""
    ctl = quiet_ctl
    servicer = ctl.servicer
    servicer.hello_timeout = 0.3
    a = await enroll(target(ctl), token(), "a")
    never = asyncio.Event()

    async def silent() -> AsyncIterator[pb.AgentMessage]:
        await never.wait()
        yield pb.AgentMessage()  # never reached

    async with target(ctl).channel() as channel:
        stub = pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
        metadata = (("x-node-id", a.node_id), ("x-node-credential", a.node_credential))
        call = stub.Connect(silent(), metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call.read(), 10)
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no Hello within 0.3 s" in (ended.value.details() or "")
    assert not ctl.services.connections.is_connected(a.node_id)


async def test_heartbeats_keep_ready_then_degraded_then_offline(ctl: RunningController) -> None:
    node_id, session = await ready_node(ctl)
    read = ctl.services.read_model
    await asyncio.sleep(2.5)  # longer than OFFLINE_AFTER: heartbeats keep it READY
    assert read.get_node(node_id)["state"] == "READY"  # type: ignore[index]
    session.stop_heartbeats()  # stream stays open, heartbeats stop
    stopped = time.monotonic()
    await wait_for(lambda: read.get_node(node_id)["state"] == "DEGRADED")  # type: ignore[index]
    degraded_after = time.monotonic() - stopped
    await wait_for(lambda: read.get_node(node_id)["state"] == "OFFLINE")  # type: ignore[index]
    offline_after = time.monotonic() - stopped
    assert 0.8 <= degraded_after < offline_after < 4.0
    assert codes(ctl, node_id)[-3:] == ["NODE_READY", "HEARTBEAT_TIMEOUT", "NODE_OFFLINE"]
    eligible = {e["node_id"] for e in read.eligibility()}
    assert node_id not in eligible
    await session.close()


async def test_degraded_node_recovers_when_heartbeats_resume(ctl: RunningController) -> None:
    node_id, session = await connected_node(ctl)
    read = ctl.services.read_model
    session.stop_heartbeats()
    await wait_for(lambda: (read.get_node(node_id) or {}).get("state") == "DEGRADED")
    assert read.eligibility()[0]["fallback_only"] is True
    session.start_heartbeats(0.2)
    await wait_for(lambda: read.get_node(node_id)["state"] == "READY")  # type: ignore[index]
    assert codes(ctl, node_id)[-2:] == ["HEARTBEAT_TIMEOUT", "NODE_RECOVERED"]
    await session.close()


async def test_closed_stream_is_offline_at_once_and_reconnect_recovers(
    ctl: RunningController,
) -> None:
    node_id, session = await ready_node(ctl)
    read = ctl.services.read_model
    await session.close()
    closed = time.monotonic()
    await wait_for(lambda: read.get_node(node_id)["state"] == "OFFLINE")  # type: ignore[index]
    assert time.monotonic() - closed < 0.9  # before DEGRADED_AFTER could have fired
    again = RawSession(target(ctl), node_id, session.credential)
    await again.open()
    again.start_heartbeats()
    await wait_for(lambda: read.get_node(node_id)["state"] == "READY")  # type: ignore[index]
    # A goodbye is a stop on purpose (NODE_STOPPED), not a loss (NODE_OFFLINE).
    assert codes(ctl, node_id)[-2:] == ["NODE_STOPPED", "NODE_RECOVERED"]
    await again.close()


async def test_a_broken_stream_leaves_the_node_to_the_heartbeat_thresholds(
    ctl: RunningController,
) -> None:
    """No goodbye: the node may be back in a moment (its jobs wait for it), so it is not
    taken offline at once; the health sweep decides, as for any silent node."""
    node_id, session = await ready_node(ctl)
    read = ctl.services.read_model
    await session.drop()
    await wait_for(lambda: read.get_node(node_id)["state"] == "OFFLINE")  # type: ignore[index]
    assert codes(ctl, node_id)[-3:] == ["NODE_READY", "HEARTBEAT_TIMEOUT", "NODE_OFFLINE"]
    offline: Any = list(ctl.services.app.repository.event_store.get(UUID(node_id)))[-1]
    assert offline.reason.startswith("no heartbeat for")


async def test_resource_report_recorded_once_per_meaningful_change(
    ctl: RunningController,
) -> None:
    from tests.integration.control_client import inventory
    from wire import control_pb2 as pb

    node_id, session = await connected_node(ctl)
    model = pb.LocalModel(file_name="m.gguf", size_bytes=100, sha256="ab" * 32, layers=30)
    report = pb.AgentMessage(
        resource_report=pb.ResourceReport(inventory=inventory(), models=[model])
    )
    for _ in range(3):
        await session.send(report)
    read = ctl.services.read_model
    await wait_for(lambda: any(e["local_models"] for e in read.eligibility()))
    await asyncio.sleep(0.3)
    assert codes(ctl, node_id).count("RESOURCES_REPORTED") == 1
    assert read.eligibility()[0]["local_models"] == ["ab" * 32]
    await session.close()


async def test_admin_api_auth_and_errors(ctl: RunningController) -> None:
    async with http(ctl) as client:
        missing = await client.get("/api/admin/nodes")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "missing_api_key"
        wrong = await client.get("/api/admin/nodes", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}
        unknown = await client.get("/api/admin/nodes/does-not-exist", headers=ADMIN)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "node_not_found"
        drain_unknown = await client.post("/api/admin/nodes/nope/drain", headers=ADMIN)
        assert drain_unknown.status_code == 404
        health = await client.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["store"] and body["live_state"]
        assert body["store_kind"] == "postgres" and body["controller_version"]


async def test_admin_lists_nodes_with_heartbeat_age(ctl: RunningController) -> None:
    node_id, session = await connected_node(ctl)
    await wait_for(lambda: ctl.services.live.get(node_id) is not None)
    # The read model is eventually consistent with the enrollment it has to show.
    await wait_for(lambda: ctl.services.read_model.get_node(node_id) is not None)
    async with http(ctl) as client:
        listing = await client.get("/api/admin/nodes", headers=ADMIN)
        assert listing.status_code == 200
        (row,) = [r for r in listing.json()["data"] if r["node_id"] == node_id]
        assert row["connected"] is True
        assert 0 <= row["heartbeat_age_seconds"] < 1.0
        assert row["telemetry"]["ram_free_bytes"] == 6 << 30
        one = await client.get(f"/api/admin/nodes/{node_id}", headers=ADMIN)
        assert one.json()["inventory"]["cpu_cores"] == 2
    await session.close()


async def test_drain_idle_node_and_resume(ctl: RunningController) -> None:
    node_id, session = await connected_node(ctl)
    await wait_for(
        lambda: (ctl.services.read_model.get_node(node_id) or {}).get("state") == "READY"
    )
    async with http(ctl) as client:
        drained = await client.post(f"/api/admin/nodes/{node_id}/drain", headers=ADMIN)
        assert drained.status_code == 202
        assert drained.json()["state"] == "DRAINING" and drained.json()["drained"] is True
        again = await client.post(f"/api/admin/nodes/{node_id}/drain", headers=ADMIN)
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "illegal_transition"
        await wait_for(lambda: any(m.WhichOneof("payload") == "drain" for m in session.received))
        resumed = await client.post(f"/api/admin/nodes/{node_id}/resume", headers=ADMIN)
        assert resumed.json()["state"] == "READY"
    assert codes(ctl, node_id)[-3:] == ["NODE_DRAIN_REQUESTED", "NODE_DRAINED", "NODE_RESUMED"]
    await session.close()


async def test_drain_busy_node_waits_for_its_job_and_survives_restart(
    pg_schema: str, tmp_path: Path
) -> None:
    from application.commands import ChatPrompt, JobOutcome, Submission

    settings = controller_settings(pg_schema, tmp_path)
    async with controller(settings) as first:
        node_id, session = await connected_node(first)
        app = first.services.app
        await wait_for(lambda: app.get_node(node_id).state == "READY")
        job = app.submit(
            Submission("m", ChatPrompt([{"role": "user", "content": "x"}]), stream=True)
        )
        job_id = job.aggregate_id
        assert job_id is not None
        app.plan_and_dispatch(job_id, one_node_plan(node_id), {node_id: "primary"})
        app.validate_setup(job_id)
        async with http(first) as client:
            r = await client.post(f"/api/admin/nodes/{node_id}/drain", headers=ADMIN)
            assert r.json()["state"] == "DRAINING" and r.json()["drained"] is False
        await session.close()
    # Controller restart: the node is still draining (its stream closed, so OFFLINE with
    # the drain pending), and the job it held ended with it.
    async with controller(settings) as second:
        row = second.services.read_model.get_node(node_id)
        assert row is not None and row["drain_requested"] is True
        again = RawSession(target(second), node_id, session.credential)
        await again.open()
        again.start_heartbeats()
        await wait_for(lambda: second.services.app.get_node(node_id).state == "DRAINING")
        assert second.services.app.get_job(job_id).state == "FAILED"
        assert "NODE_DRAINED" in codes(second, node_id)
        await again.close()
    del JobOutcome


async def test_tokens_are_single_use_and_short_lived_unless_asked(ctl: RunningController) -> None:
    async with http(ctl) as client:
        made = await client.post("/api/admin/enrollment-tokens", headers=ADMIN, json={})
        assert made.status_code == 201, made.text
        body = made.json()
        assert body["single_use"] is True
        assert 3590 < body["expires_at"] - time.time() <= 3600
        week = await client.post(
            "/api/admin/enrollment-tokens", headers=ADMIN, json={"ttl_seconds": 8 * 86400}
        )
        assert week.status_code == 400 and week.json()["error"]["param"] == "ttl_seconds"
        multi = await client.post(
            "/api/admin/enrollment-tokens", headers=ADMIN, json={"single_use": False}
        )
        assert multi.json()["single_use"] is False


async def test_minted_token_from_admin_api_enrolls(ctl: RunningController) -> None:
    async with http(ctl) as client:
        bad = await client.post(
            "/api/admin/enrollment-tokens", headers=ADMIN, json={"ttl_seconds": -5}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl_seconds"
        made = await client.post(
            "/api/admin/enrollment-tokens",
            headers=ADMIN,
            json={"ttl_seconds": 60, "single_use": True, "node_name": "bound"},
        )
        assert made.status_code == 201
        tok = made.json()["token"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await enroll(target(ctl), tok, "not-bound")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    enrolled = await enroll(target(ctl), tok, "bound")
    assert codes(ctl, enrolled.node_id) == ["NODE_ENROLLED"]
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await enroll(target(ctl), tok, "bound")
    assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS


class FlakyLiveState:
    """Wraps the real live state; its first heartbeat write fails as Redis might."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failures = 0

    def record_heartbeat(self, node_id: str, telemetry: dict[str, Any], at: float) -> None:
        if self.failures == 0:
            self.failures += 1
            raise ConnectionError("redis went away for a moment")
        self.inner.record_heartbeat(node_id, telemetry, at)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_live_state_error_does_not_cost_the_node_its_stream(
    ctl: RunningController,
) -> None:
    servicer = ctl.servicer
    flaky = FlakyLiveState(servicer.live)
    servicer.live = flaky
    node_id, session = await connected_node(ctl)
    await wait_for(lambda: flaky.failures == 1 and ctl.services.live.get(node_id) is not None)
    await asyncio.sleep(0.5)
    assert session.error is None
    assert ctl.services.connections.is_connected(node_id)
    assert "NODE_OFFLINE" not in codes(ctl, node_id)
    await session.close()


async def test_bad_messages_are_refused_alone_and_the_stream_goes_on(
    ctl: RunningController,
) -> None:
    """Malformed, oversized or out-of-order messages each get a MessageRejected; the first
    is recorded (NODE_MESSAGE_REJECTED, the rest within 10 s only counted); the node keeps
    its stream and its state."""
    node_id, session = await ready_node(ctl)
    read = ctl.services.read_model
    huge = pb.Delta(seq=0, text="x" * (5 << 20), tokens=1)  # over the 4 MiB message limit
    bad_model = pb.LocalModel(file_name="m.gguf", sha256="not-a-digest")
    bad = [
        pb.AgentMessage(),  # nothing set (or a kind this controller does not know)
        pb.AgentMessage(hello=pb.Hello(agent_version="test", node_id=node_id)),
        pb.AgentMessage(token_chunk=pb.TokenChunk(job_id="j", deltas=[huge])),
        pb.AgentMessage(token_chunk=pb.TokenChunk(job_id="j")),
        pb.AgentMessage(
            resource_report=pb.ResourceReport(inventory=inventory(), models=[bad_model])
        ),
        pb.AgentMessage(job_result=pb.JobResult(ok=True)),
    ]
    for message in bad:
        await session.send(message)

    def refused() -> list[pb.MessageRejected]:
        return [m.message_rejected for m in session.received if m.HasField("message_rejected")]

    await wait_for(lambda: len(refused()) == len(bad))
    assert [r.kind for r in refused()] == [
        "",
        "hello",
        "token_chunk",
        "token_chunk",
        "resource_report",
        "job_result",
    ]
    assert "bytes" in refused()[2].reason and "sha256" in refused()[4].reason
    await wait_for(lambda: "NODE_MESSAGE_REJECTED" in codes(ctl, node_id))
    assert codes(ctl, node_id).count("NODE_MESSAGE_REJECTED") == 1  # the others within 10 s
    # The stream lives: heartbeats still count, the node is still READY and connected.
    seen = ctl.services.live.get(node_id)
    assert seen is not None
    await wait_for(lambda: ctl.services.live.get(node_id).last_seen > seen.last_seen)  # type: ignore[union-attr]
    assert session.error is None and ctl.services.connections.is_connected(node_id)
    assert read.get_node(node_id)["state"] == "READY"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as client:
        metrics = (await client.get("/metrics")).text
    assert 'dacp_agent_messages_rejected_total{kind="token_chunk"} 2.0' in metrics
    await session.close()
