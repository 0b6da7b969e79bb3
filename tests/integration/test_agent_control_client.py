"""agent.control.control_client against a real ``grpc.aio`` server on 127.0.0.1.

The server runs :class:`FakeControlPlane`, a test double of the controller's servicer (the
real one lives in ``interfaces/``): it records every request, checks the stream metadata,
can refuse tokens or identities, push downlink messages and break streams.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest

from agent import AGENT_VERSION
from agent.agent_config import (
    DEFAULT_SLOTS,
    Backoff,
    ConfigError,
    EnrollmentRefused,
    IdentityRejected,
    parse_controller_url,
)
from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import ControlHandler, NullHandler
from agent.control.controller_channel import CONNECTION_HINT
from agent.handler_factory import build_handler
from agent.node.identity import NodeIdentity, identity_path, load_identity, save_identity
from common.contract import DEFAULT_TRANSFER_PORT, SLOTS_LABEL, TRANSFER_PORT_LABEL
from tests.integration.fake_control_plane import (
    CLOSE,
    GOOD_TOKEN,
    REFUSED_MESSAGE,
    REFUSED_TOKEN,
    FakeControlPlane,
    Outbound,
    RecordingHandler,
    eventually,
    free_port,
    make_config,
    running,
    start_server,
)
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(30)

REPO_ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


async def test_enroll_stores_identity_and_reaches_ready(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    handler = RecordingHandler()
    session = AgentSession(make_config(tmp_path, controller_url), handler)
    assert session.state == AgentState.UNINITIALIZED
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)

        [request] = fake.enroll_requests
        assert request.enrollment_token == GOOD_TOKEN
        assert request.node_name == "test-node"
        assert request.agent_version == AGENT_VERSION
        assert request.inventory.advertised_address == "127.0.0.1"
        assert request.inventory.rpc_port == 50052
        assert request.inventory.cpu_threads >= 1 and request.inventory.ram_total_bytes > 0
        assert dict(request.inventory.labels) == {"zone": "lab", SLOTS_LABEL: "2"}

        stored = load_identity(tmp_path / "agent-data")
        assert stored is not None
        assert stored.node_id == "node-1" == session.node_id
        assert stored.node_credential == fake.credentials["node-1"]
        assert stored.controller_url == controller_url
        assert stored.node_name == "test-node"

        [stream] = fake.streams
        assert stream.metadata["x-node-id"] == "node-1"
        assert stream.metadata["x-node-credential"] == fake.credentials["node-1"]
        assert session.controller_version == "fake-1"
    assert session.state_history == [
        AgentState.UNINITIALIZED,
        AgentState.REGISTERING,
        AgentState.READY,
    ]
    assert handler.closed


async def test_hello_then_report_then_heartbeats_at_configured_interval(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    handler = RecordingHandler()
    # The controller asks for 1 s; the config overrides it with 0.1 s.
    session = AgentSession(make_config(tmp_path, controller_url, heartbeat_interval=0.1), handler)
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)
        await eventually(lambda: len(fake.streams[0].of_kind("heartbeat")) >= 5)
        stream = fake.streams[0]
        kinds = stream.kinds()
        assert kinds[:2] == ["hello", "resource_report"]
        assert set(kinds[2:]) == {"heartbeat"}

        hello = stream.received[0][1].hello
        assert (hello.agent_version, hello.node_id) == (AGENT_VERSION, "node-1")
        report = stream.received[1][1].resource_report
        assert report.inventory.advertised_address == "127.0.0.1"
        assert list(report.models) == []  # empty models dir

        beats = stream.of_kind("heartbeat")
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(beats)]
        assert 0.08 <= statistics.median(gaps) <= 0.5
        beat = beats[-1][1].heartbeat
        assert list(beat.active_job_ids) == ["job-a", "job-b"]
        assert beat.ram_free_bytes > 0 and 0.0 <= beat.cpu_percent <= 100.0
        assert beat.sent_at_unix_ms > 0
        assert session.heartbeat_interval == 0.1


async def test_restart_reuses_identity_without_enrolling_again(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    fake.heartbeat_interval = 0.15
    first = AgentSession(
        make_config(tmp_path, controller_url, heartbeat_interval=None), NullHandler()
    )
    async with running(first):
        await first.wait_for_state(AgentState.READY, timeout=10)
    assert first.heartbeat_interval == 0.15  # the controller's interval when not overridden

    # Restart: no URL on the command line (taken from identity.json), token still configured.
    second = AgentSession(make_config(tmp_path, None), NullHandler())
    async with running(second):
        await second.wait_for_state(AgentState.READY, timeout=10)
        await eventually(lambda: len(fake.streams) == 2 and len(fake.streams[1].received) >= 2)
    assert len(fake.enroll_requests) == 1
    assert [s.node_id for s in fake.streams] == ["node-1", "node-1"]
    assert fake.streams[1].kinds()[:2] == ["hello", "resource_report"]


async def test_refused_token_raises_enrollment_refused(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    handler = RecordingHandler()
    session = AgentSession(
        make_config(tmp_path, controller_url, enrollment_token=REFUSED_TOKEN), handler
    )
    with pytest.raises(EnrollmentRefused) as refused:
        await asyncio.wait_for(session.run(), timeout=10)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert REFUSED_MESSAGE in str(refused.value)
    assert len(fake.enroll_requests) == 1  # fatal: not retried
    assert fake.connect_attempts == 0
    assert load_identity(tmp_path / "agent-data") is None
    assert AgentState.READY not in session.state_history
    assert handler.closed


async def test_controller_down_at_start_backs_off_then_connects(
    tmp_path: Path, fake: FakeControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent")
    port = free_port()
    url = f"127.0.0.1:{port}"
    # Jitter pinned to the ceiling so the delays are deterministic: 0.05, 0.1, 0.2 (cap), 0.2.
    session = AgentSession(
        make_config(tmp_path, url, backoff_initial=0.05, backoff_max=0.2),
        NullHandler(),
        jitter=lambda low, high: high,
    )
    server: grpc.aio.Server | None = None
    try:
        async with running(session):
            await eventually(lambda: session.failed_attempts >= 4)
            assert session.state == AgentState.REGISTERING
            server, _ = await start_server(fake, port)
            await session.wait_for_state(AgentState.READY, timeout=10)
    finally:
        if server is not None:
            await server.stop(None)

    lines = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(lines) >= 4
    for line in lines:
        assert "\n" not in line
        assert CONNECTION_HINT in line
        assert f"({url})" in line
        assert line.startswith("enroll attempt")
    delays = [
        float(m.group(1)) for m in (re.search(r"retrying in ([0-9.]+)s", x) for x in lines) if m
    ]
    assert delays[:4] == [0.05, 0.1, 0.2, 0.2]
    assert len(fake.enroll_requests) == 1


@pytest.mark.parametrize("how", [grpc.StatusCode.UNAVAILABLE, CLOSE], ids=["abort", "close"])
async def test_stream_broken_by_server_reconnects(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str, how: Outbound
) -> None:
    session = AgentSession(make_config(tmp_path, controller_url), RecordingHandler())
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)
        fake.streams[0].outbound.put_nowait(how)
        await eventually(lambda: session.connections == 2 and session.state == AgentState.READY)
        await eventually(lambda: "heartbeat" in fake.streams[1].kinds())
    assert session.state_history == [
        AgentState.UNINITIALIZED,
        AgentState.REGISTERING,
        AgentState.READY,
        AgentState.REGISTERING,
        AgentState.READY,
    ]
    assert len(fake.enroll_requests) == 1
    assert fake.streams[1].kinds()[:2] == ["hello", "resource_report"]


async def test_controller_restart_reconnects_with_same_identity(
    tmp_path: Path, fake: FakeControlPlane
) -> None:
    server, port = await start_server(fake)
    session = AgentSession(make_config(tmp_path, f"127.0.0.1:{port}"), NullHandler())
    try:
        async with running(session):
            await session.wait_for_state(AgentState.READY, timeout=10)
            await server.stop(None)
            await session.wait_for_state(AgentState.REGISTERING, timeout=5)
            await eventually(lambda: session.failed_attempts >= 2)
            server, _ = await start_server(fake, port)
            await session.wait_for_state(AgentState.READY, timeout=10)
            assert session.connections == 2
    finally:
        await server.stop(None)
    assert len(fake.enroll_requests) == 1
    assert [s.node_id for s in fake.streams] == ["node-1", "node-1"]


async def test_downlink_messages_reach_the_handler(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    handler = RecordingHandler()
    fake.resumed = dict.fromkeys(handler.jobs, 0)  # its running jobs go on
    session = AgentSession(make_config(tmp_path, controller_url), handler)
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)
        outbound = fake.streams[0].outbound
        outbound.put_nowait(pb.ControllerMessage(cancel_job=pb.CancelJob(job_id="j1")))
        outbound.put_nowait(pb.ControllerMessage(drain=pb.Drain()))
        await asyncio.wait_for(handler.drained.wait(), timeout=5)
        outbound.put_nowait(pb.ControllerMessage(resume=pb.Resume()))
        outbound.put_nowait(pb.ControllerMessage(stop_rpc_worker=pb.StopRpcWorker(job_id="j2")))
        outbound.put_nowait(pb.ControllerMessage(stop_server=pb.StopServer(reason="idle")))
        await eventually(lambda: len(handler.calls) == 5)
    assert handler.calls == [
        "cancel:j1",
        "drain",
        "resume",
        "stop_rpc_worker:j2",
        "stop_server:idle",
    ]
    assert session.state == AgentState.READY  # draining is the controller's state, not ours


async def test_null_handler_refuses_plans(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    handler = build_handler(make_config(tmp_path, controller_url))
    assert isinstance(handler, NullHandler) and isinstance(handler, ControlHandler)
    session = AgentSession(make_config(tmp_path, controller_url), handler)
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)
        plan = pb.ExecutionPlan(job_id="job-9", role=pb.ExecutionPlan.PRIMARY)
        fake.streams[0].outbound.put_nowait(pb.ControllerMessage(execution_plan=plan))
        start = pb.StartRpcWorker(job_id="job-9", host="127.0.0.1", port=50052)
        fake.streams[0].outbound.put_nowait(pb.ControllerMessage(start_rpc_worker=start))
        stream = fake.streams[0]
        await eventually(
            lambda: (
                bool(stream.of_kind("setup_result")) and bool(stream.of_kind("rpc_worker_status"))
            )
        )
    result = stream.of_kind("setup_result")[0][1].setup_result
    assert (result.job_id, result.ok, result.error, result.role) == (
        "job-9",
        False,
        "no runtime configured",
        "primary",
    )
    status = stream.of_kind("rpc_worker_status")[0][1].rpc_worker_status
    assert (status.job_id, status.state) == ("job-9", pb.RpcWorkerStatus.FAILED)


async def test_resource_report_resent_when_models_change(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    config = make_config(tmp_path, controller_url, resource_check_interval=0.1)
    session = AgentSession(config, NullHandler())
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)
        stream = fake.streams[0]
        await asyncio.sleep(0.5)  # several checks, nothing changed
        assert len(stream.of_kind("resource_report")) == 1
        config.resolved_models_dir.mkdir(parents=True, exist_ok=True)
        (config.resolved_models_dir / "new.gguf").write_bytes(b"not really a gguf" * 10)
        await eventually(lambda: len(stream.of_kind("resource_report")) == 2)
        await asyncio.sleep(0.3)
        assert len(stream.of_kind("resource_report")) == 2  # only on change
    [model] = stream.of_kind("resource_report")[1][1].resource_report.models
    assert model.file_name == "new.gguf" and model.error


async def test_unauthenticated_connect_raises_identity_rejected(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    data_dir = tmp_path / "agent-data"
    save_identity(data_dir, NodeIdentity.new("node-gone", "stale", controller_url, "test-node"))
    handler = RecordingHandler()
    session = AgentSession(make_config(tmp_path, controller_url), handler)
    with pytest.raises(IdentityRejected) as rejected:
        await asyncio.wait_for(session.run(), timeout=10)
    assert "node-gone" in str(rejected.value)
    assert str(identity_path(data_dir)) in str(rejected.value)
    assert fake.connect_attempts == fake.rejected_connects == 1  # no retry loop
    assert fake.enroll_requests == []  # a stored identity is never silently replaced
    assert handler.closed


async def test_stop_before_ready_is_clean(tmp_path: Path) -> None:
    session = AgentSession(make_config(tmp_path, f"127.0.0.1:{free_port()}"), RecordingHandler())
    task = asyncio.create_task(session.run())
    await eventually(lambda: session.failed_attempts >= 1)
    await session.stop()
    assert task.done() and task.exception() is None
    assert isinstance(session.handler, RecordingHandler) and session.handler.closed


# --- pure helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "insecure", "address", "secure"),
    [
        ("10.0.0.5:50051", False, "10.0.0.5:50051", True),  # TLS unless asked otherwise
        ("10.0.0.5:50051", True, "10.0.0.5:50051", False),
        ("controller.lan", False, "controller.lan:50051", True),
        ("grpc://controller.lan:6000", True, "controller.lan:6000", False),
        ("grpcs://controller.lan:443/", False, "controller.lan:443", True),
        ("GRPCS://[fd00::1]:50051", False, "[fd00::1]:50051", True),
    ],
)
def test_parse_controller_url(url: str, insecure: bool, address: str, secure: bool) -> None:
    target = parse_controller_url(url, insecure=insecure)
    assert (target.address, target.secure, target.url) == (address, secure, url)


@pytest.mark.parametrize(
    "url", ["", "http://c:1", "grpc://c:1/path", "grpc://:50051", "c:notaport", "grpc://c:0"]
)
def test_parse_controller_url_rejects(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_controller_url(url, insecure=True)


def test_plaintext_needs_an_explicit_insecure() -> None:
    with pytest.raises(ConfigError, match="--insecure"):
        parse_controller_url("grpc://c:1")
    with pytest.raises(ConfigError, match="TLS"):
        parse_controller_url("grpcs://c:1", insecure=True)


def test_backoff_full_jitter_is_capped() -> None:
    backoff = Backoff(0.5, 30.0)
    ceilings = []
    for _ in range(12):
        ceiling = backoff.ceiling()
        ceilings.append(ceiling)
        assert 0.0 <= backoff.next_delay() <= ceiling
    assert ceilings[:7] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert max(ceilings) == 30.0
    backoff.reset()
    assert backoff.ceiling() == 0.5


# --- the CLI -------------------------------------------------------------------------------


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DACP_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


async def agent_process(env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    """``node-agent args`` started, its output piped."""
    pipe = asyncio.subprocess.PIPE
    command = (sys.executable, "-m", "agent.main", *args)
    return await asyncio.create_subprocess_exec(
        *command, stdout=pipe, stderr=pipe, env=env, cwd=REPO_ROOT
    )


def usage_error(*args: str) -> tuple[str, str]:
    """Runs ``node-agent args``, which must exit 2; its one stderr line and its stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "agent.main", *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO_ROOT,
        timeout=20,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0], result.stdout


def test_cli_without_token_or_identity_exits_2(tmp_path: Path) -> None:
    data_dir = str(tmp_path / "agent-data")
    line, stdout = usage_error("--controller-url", "127.0.0.1:9", "--data-dir", data_dir)
    assert line.startswith("node-agent: error: no enrollment token and no stored identity")
    assert stdout == ""


def test_cli_bad_flag_exits_2_with_one_line(tmp_path: Path) -> None:
    line, _ = usage_error("--slots", "0", "--data-dir", str(tmp_path))
    assert "--slots" in line


async def test_cli_refused_token_exits_2(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    process = await agent_process(
        cli_env(),
        "--foreground",
        "--controller-url",
        f"grpc://{controller_url}",
        "--insecure",
        "--enrollment-token",
        REFUSED_TOKEN,
        "--data-dir",
        str(tmp_path / "agent-data"),
        "--advertise-address",
        "127.0.0.1",
        "--log-level",
        "ERROR",
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode == 2
    errors = [ln for ln in stderr.decode().splitlines() if ln.startswith("node-agent: error:")]
    assert len(errors) == 1, stderr.decode()
    assert "enrollment refused" in errors[0] and REFUSED_MESSAGE in errors[0]
    assert [r.enrollment_token for r in fake.enroll_requests] == [REFUSED_TOKEN]


async def test_cli_enrolls_heartbeats_and_stops_cleanly_on_sigterm(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    data_dir = tmp_path / "agent-data"
    process = await agent_process(
        {**cli_env(), "DACP_ENROLLMENT_TOKEN": GOOD_TOKEN},
        "--controller-url",
        controller_url,
        "--insecure",  # the fake controller speaks plaintext
        "--data-dir",
        str(data_dir),
        "--node-name",
        "cli-node",
        "--advertise-address",
        "127.0.0.1",
        "--heartbeat-interval",
        "0.1",
        "--label",
        "rack=r1",
    )
    try:
        await eventually(
            lambda: bool(fake.streams) and len(fake.streams[0].of_kind("heartbeat")) >= 2,
            timeout=15,
        )
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)  # the agent's loop handler stops it cleanly
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=15)
    assert process.returncode == 0, stderr.decode()
    assert "agent stopped" in stderr.decode()
    [request] = fake.enroll_requests
    assert request.node_name == "cli-node"
    assert dict(request.inventory.labels) == {
        "rack": "r1",
        SLOTS_LABEL: str(DEFAULT_SLOTS),
        TRANSFER_PORT_LABEL: str(DEFAULT_TRANSFER_PORT),  # the CLI serves model files
    }
    stored = load_identity(data_dir)
    assert stored is not None and stored.node_id == fake.streams[0].node_id


def self_signed_cert(directory: Path) -> tuple[bytes, bytes]:
    """(key PEM, cert PEM) for 127.0.0.1, made with the openssl CLI."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=dacp-test-controller",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return key.read_bytes(), cert.read_bytes()


async def test_grpcs_with_ca_file_connects_and_without_it_is_refused(
    tmp_path: Path, fake: FakeControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    key, cert = self_signed_cert(tmp_path)
    server = grpc.aio.server()
    pb_grpc.add_ControlPlaneServicer_to_server(fake, server)  # type: ignore[no-untyped-call]
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    await server.start()
    url = f"grpcs://127.0.0.1:{port}"
    try:
        # System roots do not trust the self-signed certificate: a failed attempt with the hint.
        caplog.set_level(logging.WARNING, logger="agent")
        untrusted = AgentSession(make_config(tmp_path / "a", url, insecure=False), NullHandler())
        async with running(untrusted):
            await eventually(lambda: untrusted.failed_attempts >= 1)
        assert CONNECTION_HINT in caplog.text and fake.enroll_requests == []

        ca_file = tmp_path / "cert.pem"
        config = make_config(tmp_path / "b", url, tls_ca_file=ca_file, insecure=False)
        trusted = AgentSession(config, NullHandler())
        async with running(trusted):
            await trusted.wait_for_state(AgentState.READY, timeout=10)
        assert len(fake.enroll_requests) == 1 and len(fake.streams) == 1
    finally:
        await server.stop(None)
