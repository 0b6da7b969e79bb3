"""The controller pin, attacked by an enrolled node: node certificates come from the
controller's CA and are valid server certificates, so a node can stand up a TLS server that
shows a certificate chaining to the pinned CA. The agent must verify the controller under the
controller's own identity (``common.contract.CONTROLLER_TLS_NAME``, or the host of the URL it was
given for an operator's certificate), never under a name read from the certificate it is shown: the
impostor then never sees an enrollment token or a node credential.

Every test runs a real controller (in this process, TLS with the CA it makes) and, as the
attacker, a real gRPC server with TLS that presents a node certificate the controller issued
to a node enrolled with it; the victim is a real ``node-agent`` process."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import NullHandler
from agent.control.controller_channel import CONNECTION_HINT
from agent.node.identity import NodeIdentity, load_identity, save_identity
from common.contract import CONTROLLER_TLS_NAME
from common.transfer_ticket import node_tls_name
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.integration.control_client import RawSession, control_target, enroll
from tests.integration.fake_control_plane import FakeControlPlane
from tests.security.node_agent import agent_command, agent_env
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]
#: What the agent prints when it stops on a fatal error (agent/main.py).
AGENT_ERROR = "node-agent: error:"


# --- the attacker ------------------------------------------------------------------------


class CsrSession(RawSession):
    """A Connect stream whose Hello asks for a node certificate, as a real agent's does."""

    def __init__(self, *args: Any, csr_pem: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.csr_pem = csr_pem

    async def _requests(self) -> AsyncIterator[pb.AgentMessage]:
        hello = pb.Hello(agent_version="test", node_id=self.hello_id, csr_pem=self.csr_pem)
        yield pb.AgentMessage(hello=hello)
        while True:
            item = await self.outbox.get()
            if item is None:
                return
            yield item


async def insider_certificate(ctl: RunningController) -> tuple[str, bytes, bytes]:
    """An enrolled node's own certificate, issued by the controller in its Welcome: (node
    id, certificate PEM, key PEM)."""
    enrolled = await enroll(control_target(ctl), mint(ctl), "insider")
    key = ec.generate_private_key(ec.SECP256R1())
    # The insider asks for the controller's name outright: the controller ignores it.
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CONTROLLER_TLS_NAME)]))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(CONTROLLER_TLS_NAME)]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    session = CsrSession(
        control_target(ctl),
        enrolled.node_id,
        enrolled.node_credential,
        csr_pem=csr.public_bytes(serialization.Encoding.PEM).decode(),
    )
    first = await session.open()
    await session.close()
    certificate = first.welcome.node_certificate_pem.encode()
    assert certificate, "the controller issued the insider no certificate"
    issued = x509.load_pem_x509_certificate(certificate)
    san = issued.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [node_tls_name(enrolled.node_id)]
    assert issued.subject.rfc4514_string() == f"CN={node_tls_name(enrolled.node_id)}"
    assert (
        ExtendedKeyUsageOID.SERVER_AUTH
        in issued.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )  # a valid server certificate: the node serves model files with it
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return enrolled.node_id, certificate, key_pem


class Impostor(FakeControlPlane):
    """A fake controller that accepts every token and every credential (a relay would), and
    records what each call brought."""

    def __init__(self) -> None:
        super().__init__(heartbeat_interval=0.2)
        self.presented_credentials: list[str] = []

    async def Enroll(
        self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EnrollResponse:
        self.tokens.add(request.enrollment_token)
        return await super().Enroll(request, context)

    async def Connect(
        self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        metadata = {str(k): str(v) for k, v in (context.invocation_metadata() or ())}
        credential = metadata.get("x-node-credential", "")
        self.presented_credentials.append(credential)
        self.credentials.setdefault(metadata.get("x-node-id", ""), credential)
        await super().Connect(request_iterator, context)


@contextlib.asynccontextmanager
async def impostor_serving(
    ctl: RunningController, certificate: bytes, key: bytes
) -> AsyncIterator[tuple[Impostor, int]]:
    """The impostor on 127.0.0.1, presenting ``certificate`` followed by the controller's CA
    (so that the CA the token names is in the chain it shows)."""
    tls = ctl.services.tls
    assert tls is not None
    servicer = Impostor()
    server = grpc.aio.server()
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    credentials = grpc.ssl_server_credentials([(key, certificate + tls.ca_pem)])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(None)


# --- the victim ----------------------------------------------------------------------------


def mint(ctl: RunningController) -> str:
    return ctl.services.enrollment.mint(
        ttl_seconds=120, single_use=True, node_name=None, now=time.time()
    ).token


class AgentProcess:
    """``node-agent`` (``python -m agent.main``), its stderr in a file the test reads."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process = process
        self.log = log

    @classmethod
    async def start(cls, data_dir: Path, url: str, *extra: str) -> AgentProcess:
        log = data_dir.parent / f"{data_dir.name}-{time.monotonic_ns()}.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *agent_command(url, data_dir, "victim", "--heartbeat-interval", "0.2", *extra),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=out,
                env=agent_env(),
                cwd=REPO,
            )
        return cls(process, log)

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None

    async def until(self, predicate: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"nothing happened in time:\n{self.stderr}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 0.05)

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), 20)


# --- the attacks ---------------------------------------------------------------------------


async def test_a_node_certificate_does_not_pass_the_pin_and_never_sees_the_token(
    ctl: RunningController, tmp_path: Path
) -> None:
    """A new agent is given a genuine token and, through a spoofed address, reaches an
    enrolled node posing as the controller with its own certificate: the agent stops with the
    TLS hint before it sends the token, and saves nothing."""
    _, certificate, key = await insider_certificate(ctl)
    token = mint(ctl)
    data_dir = tmp_path / "victim"
    async with impostor_serving(ctl, certificate, key) as (impostor, port):
        agent = await AgentProcess.start(data_dir, f"127.0.0.1:{port}", "--enrollment-token", token)
        try:
            await agent.until(lambda: agent.exited or bool(impostor.enroll_requests))
        finally:
            code = await agent.stop()
        assert [r.enrollment_token for r in impostor.enroll_requests] == []
        assert impostor.presented_credentials == []
    assert code == 2, agent.stderr
    [error] = [line for line in agent.stderr.splitlines() if line.startswith(AGENT_ERROR)]
    assert "TLS settings" in error and CONTROLLER_TLS_NAME in error, error
    assert load_identity(data_dir) is None
    # The token was never spent: the genuine controller still takes it.
    assert (await enroll(control_target(ctl), token, "victim")).node_id


async def test_an_identity_saved_under_the_old_rule_is_verified_again(
    ctl: RunningController, tmp_path: Path
) -> None:
    """identity.json holds the real controller's CA and a genuine credential, but the server
    name an impostor's certificate carried when the agent enrolled through it (the old rule
    took it from the presented leaf). The impostor gets no credential; the real controller
    still takes the agent, and the name is replaced by the controller's own."""
    insider, certificate, key = await insider_certificate(ctl)
    tls = ctl.services.tls
    assert tls is not None
    genuine = await enroll(control_target(ctl), mint(ctl), "victim")
    data_dir = tmp_path / "victim"
    save_identity(
        data_dir,
        NodeIdentity(
            node_id=genuine.node_id,
            node_credential=genuine.node_credential,
            controller_url="127.0.0.1:1",
            node_name="victim",
            enrolled_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            controller_ca_pem=tls.ca_pem.decode(),
            tls_server_name=node_tls_name(insider),
        ),
    )
    async with impostor_serving(ctl, certificate, key) as (impostor, port):
        agent = await AgentProcess.start(data_dir, f"127.0.0.1:{port}")
        try:
            await agent.until(
                lambda: (
                    agent.exited
                    or bool(impostor.presented_credentials)
                    or agent.stderr.count(CONNECTION_HINT) >= 2
                )
            )
        finally:
            await agent.stop()
        assert impostor.presented_credentials == []
    assert agent.stderr.count(CONNECTION_HINT) >= 2, agent.stderr
    assert CONTROLLER_TLS_NAME in agent.stderr

    real = await AgentProcess.start(data_dir, f"127.0.0.1:{ctl.grpc_port}")
    try:
        await real.until(lambda: real.exited or "connected to controller" in real.stderr)
    finally:
        code = await real.stop()
    assert code == 0, real.stderr
    assert f"as node {genuine.node_id}" in real.stderr
    stored = load_identity(data_dir)
    assert stored is not None and stored.tls_server_name == CONTROLLER_TLS_NAME


# --- the genuine controller still passes ---------------------------------------------------


def _operator_certificate(tmp_path: Path, ip: str) -> tuple[Path, Path]:
    """An operator's own CA and a server certificate for ``ip`` only (no dacp name)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "operator CA")])
    now = dt.datetime.now(dt.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "controller.lan")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("controller.lan"), x509.IPAddress(ipaddress.ip_address(ip))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "operator.pem", tmp_path / "operator.key"
    cert_file.write_bytes(
        leaf.public_bytes(serialization.Encoding.PEM) + ca.public_bytes(serialization.Encoding.PEM)
    )
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


async def test_an_operator_certificate_is_verified_under_the_url_host(
    pg_schema: str, tmp_path: Path
) -> None:
    """With the operator's own certificate (no dacp name in it) the agent verifies the
    controller as any TLS client does: under the host of the URL it was given."""
    cert_file, key_file = _operator_certificate(tmp_path, "127.0.0.1")
    settings = controller_settings(
        pg_schema, tmp_path, tls_cert_file=cert_file, tls_key_file=key_file
    )
    async with controller(settings) as ctl:
        config = AgentConfig(
            data_dir=tmp_path / "agent",
            node_name="operator-pinned",
            controller_url=f"127.0.0.1:{ctl.grpc_port}",
            enrollment_token=mint(ctl),
            heartbeat_interval=0.2,
            backoff_initial=0.05,
            backoff_max=0.2,
        )
        session = AgentSession(config, NullHandler())
        task = asyncio.create_task(session.run())
        try:
            await session.wait_for_state(AgentState.READY, timeout=20)
        finally:
            await session.stop()
            await asyncio.gather(task, return_exceptions=True)
    stored = load_identity(tmp_path / "agent")
    assert stored is not None and stored.tls_server_name == "127.0.0.1"
