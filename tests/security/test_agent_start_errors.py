"""A new operator's first mistakes, met by a real ``node-agent`` process and a real controller:
each ends the agent at once with one line that names the real cause, instead of retries that
look like a network fault.

* a garbled or truncated token: named, and sent nowhere (no connection is even attempted);
* a token the controller refuses (expired, revoked, used up): its reason, times in ISO 8601;
* the controller's HTTP port instead of its gRPC port, plain HTTP or HTTPS: "this is the
  HTTP API", and the controller's warning about the bad request names the agent's address;
* a token from another controller: the CA it names is not the one presented;
* gRPC core's own stderr lines only with ``--grpc-debug``;
* a certificate gRPC could not verify (retried): which CA was expected.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession
from agent.control.control_handler import NullHandler
from agent.control.controller_probe import http_status_line
from agent.node.identity import NodeIdentity, save_identity
from common.contract import CONTROLLER_TLS_NAME
from infrastructure.tls import load_or_create
from interfaces.controller_main import RunningController
from interfaces.http.http_peer_log import UVICORN_ERROR_LOGGER
from tests.integration.control_client import control_target, enroll
from tests.integration.fake_control_plane import FakeControlPlane, free_port, start_server
from tests.security.conftest import controller_in
from tests.security.controller_process import signed_token
from tests.security.controller_process import token as namespace_token
from tests.security.netns import Namespace
from tests.security.node_agent import agent_command, agent_env
from wire.grpc_verbosity import OPERATOR_VARIABLES

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
#: What the agent prints when it stops on a fatal error (agent/main.py).
AGENT_ERROR = "node-agent: error:"
HTTP_API = "this is the HTTP API; the control channel is on GRPC_PORT (50051 by default)"
#: gRPC core's own handshake lines (what an operator saw for every attempt).
CORE_NOISE = "ssl_transport_security"


@dataclass
class Ended:
    code: int
    stderr: str

    @property
    def error(self) -> str:
        """The one error line."""
        [line] = [x for x in self.stderr.splitlines() if x.startswith(AGENT_ERROR)]
        return line


def _token(ca_fingerprint: str | None = None) -> str:
    """A single-use enrollment token signed with the test controller's secret."""
    return signed_token(ca_fingerprint, ttl_seconds=60, single_use=True)


async def agent(tmp_path: Path, url: str, *extra: str, address: str = "127.0.0.1") -> Ended:
    """Runs ``node-agent`` (``python -m agent.main``) until it exits on its own (at most 60 s)."""
    env = agent_env()
    for name in OPERATOR_VARIABLES:
        env.pop(name, None)
    data_dir = tmp_path / f"agent-{time.monotonic_ns()}"
    process = await asyncio.create_subprocess_exec(
        *agent_command(url, data_dir, "newcomer", *extra, address=address),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    except TimeoutError:
        process.kill()
        _, stderr = await process.communicate()
        raise AssertionError(f"the agent did not stop by itself:\n{stderr.decode()}") from None
    assert process.returncode is not None
    return Ended(process.returncode, stderr.decode(errors="replace"))


def mint(ctl: RunningController, *, ttl: float = 120, now: float | None = None) -> str:
    return ctl.services.enrollment.mint(
        ttl_seconds=ttl, single_use=True, node_name=None, now=now or time.time()
    ).token


@pytest.fixture
def uvicorn_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """uvicorn's own logger does not propagate to the root: its records go to caplog too."""
    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


# --- the token ------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 5, 12])
async def test_a_truncated_token_is_named_and_no_connection_is_attempted(
    ctl: RunningController, tmp_path: Path, cut: int
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        ended = await agent(tmp_path, f"127.0.0.1:{port}", "--enrollment-token", mint(ctl)[:-cut])
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    assert ended.code == 2, ended.stderr
    assert "the enrollment token is malformed or truncated: its " in ended.error
    assert "retrying" not in ended.stderr


async def test_a_garbled_token_says_what_is_wrong(ctl: RunningController, tmp_path: Path) -> None:
    ended = await agent(
        tmp_path, f"127.0.0.1:{ctl.grpc_port}", "--enrollment-token", "paste-the-token-here"
    )
    assert ended.code == 2, ended.stderr
    assert ended.error.endswith(
        "the enrollment token is malformed or truncated: it must look like "
        "dacp1.<claims>.<mac>; copy it again whole, or mint a new one (dacp token create)"
    )
    assert ctl.services.read_model.list_nodes() == []


@pytest.mark.parametrize("refusal", ["expired", "revoked", "used up"])
async def test_a_refused_token_is_not_retried_and_the_reason_is_shown(
    ctl: RunningController, tmp_path: Path, refusal: str
) -> None:
    if refusal == "expired":
        token = mint(ctl, ttl=60, now=time.time() - 3600)
        reason = r"expired at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(now \d{4}-\d\d-\d\dT[0-9:]{8}Z\)"
    elif refusal == "revoked":
        minted = ctl.services.enrollment.mint(
            ttl_seconds=120, single_use=True, node_name=None, now=time.time()
        )
        ctl.services.app.revoke_token(minted.token_id, "test", "lost on a sticky note")
        token = minted.token
        reason = "was revoked"
    else:
        token = mint(ctl)
        await enroll(control_target(ctl), token, "first")
        reason = "single-use and was already redeemed"
    ended = await agent(tmp_path, f"127.0.0.1:{ctl.grpc_port}", "--enrollment-token", token)
    assert ended.code == 2, ended.stderr
    assert "enrollment refused by the controller" in ended.error
    assert re.search(reason, ended.error), ended.error
    assert "retrying" not in ended.stderr


async def test_a_token_from_another_controller_is_named(
    ctl: RunningController, tmp_path: Path
) -> None:
    other = load_or_create(tmp_path / "other-ca")
    token = _token(ca_fingerprint=other.fingerprint)
    ended = await agent(tmp_path, f"127.0.0.1:{ctl.grpc_port}", "--enrollment-token", token)
    assert ended.code == 2, ended.stderr
    assert f"127.0.0.1:{ctl.grpc_port} did not present the CA the enrollment token names" in (
        ended.error
    )
    assert "the token comes from another controller" in ended.error
    assert ctl.services.read_model.list_nodes() == []


# --- the HTTP port --------------------------------------------------------------------------


async def test_the_probe_tells_http_from_grpc(ctl: RunningController) -> None:
    """Only an HTTP/1.x server is taken for one: never a gRPC server, with TLS or without."""
    plaintext, port = await start_server(FakeControlPlane())
    try:
        probes = [
            asyncio.to_thread(http_status_line, "127.0.0.1", p)
            for p in (ctl.grpc_port, port, free_port(), ctl.http_port)
        ]
        tls_grpc, plain_grpc, closed, http = await asyncio.gather(*probes)
    finally:
        await plaintext.stop(None)
    assert (tls_grpc, plain_grpc, closed) == (None, None, None)
    assert http is not None and http.startswith("HTTP/1.1 "), http


async def test_the_plain_http_port_is_named_and_the_controller_names_the_agent(
    ctl: RunningController, tmp_path: Path, uvicorn_warnings: pytest.LogCaptureFixture
) -> None:
    """The controller serves plain HTTP on loopback: the agent's TLS handshake (to pin the CA)
    is a bad request there."""
    url = f"127.0.0.1:{ctl.http_port}"
    ended = await agent(tmp_path, url, "--enrollment-token", mint(ctl))
    assert ended.code == 2, ended.stderr
    assert f"{url} answers HTTP ('HTTP/1.1 " in ended.error
    assert HTTP_API in ended.error
    assert "retrying" not in ended.stderr
    warnings = [r.getMessage() for r in uvicorn_warnings.records if "Invalid HTTP" in r.msg]
    assert warnings  # the pin's handshake, and the probe's
    for warning in warnings:
        assert warning.startswith("Invalid HTTP request received. (from 127.0.0.1:"), warning
        assert "a TLS handshake on the plain HTTP port" in warning


async def test_an_insecure_agent_on_the_http_port_is_named(
    ctl: RunningController, tmp_path: Path, uvicorn_warnings: pytest.LogCaptureFixture
) -> None:
    url = f"127.0.0.1:{ctl.http_port}"
    ended = await agent(tmp_path, url, "--insecure", "--enrollment-token", mint(ctl))
    assert ended.code == 2, ended.stderr
    assert HTTP_API in ended.error and url in ended.error
    warnings = [r.getMessage() for r in uvicorn_warnings.records if r.levelno >= logging.WARNING]
    assert any("(from 127.0.0.1:" in w and "HTTP/2 without TLS" in w for w in warnings), warnings


async def test_grpc_core_prints_its_lines_only_when_asked(
    ctl: RunningController, tmp_path: Path
) -> None:
    """With --tls-ca-file gRPC itself meets the plain HTTP port (no pin first): by default its
    core's handshake lines stay off stderr, with --grpc-debug they are there."""
    tls = ctl.services.tls
    assert tls is not None
    ca = tmp_path / "ca.pem"
    ca.write_bytes(tls.ca_pem)
    url = f"127.0.0.1:{ctl.http_port}"
    args = ("--tls-ca-file", str(ca), "--enrollment-token", mint(ctl))
    quiet = await agent(tmp_path, url, *args)
    assert quiet.code == 2 and HTTP_API in quiet.error, quiet.stderr
    assert CORE_NOISE not in quiet.stderr
    debug = await agent(tmp_path, url, *args, "--grpc-debug")
    assert debug.code == 2 and HTTP_API in debug.error, debug.stderr
    assert CORE_NOISE in debug.stderr


async def test_the_https_port_is_named(namespace: Namespace, tmp_path: Path) -> None:
    """Beyond loopback the controller serves HTTPS, with the very certificate the token's CA
    issued: the pin passes, and gRPC finds no HTTP/2 there."""
    # No job runs here: a stop need not wait for any (SHUTDOWN_TIMEOUT bounds the drain).
    with controller_in(namespace, tmp_path, SHUTDOWN_TIMEOUT="1") as env:
        url = f"{namespace.inside}:{env['PORT']}"
        ended = await agent(
            tmp_path, url, "--enrollment-token", namespace_token(env), address=namespace.outside
        )
        failed_handshake(env["GRPC"])
    assert ended.code == 2, ended.stderr
    assert f"{url} answers HTTP ('HTTP/1.1 " in ended.error
    assert HTTP_API in ended.error
    # The controller (dacp controller) keeps gRPC core's lines below ERROR to itself.
    assert CORE_NOISE not in Path(env["LOG"]).read_text(errors="replace")


async def test_the_controller_prints_grpc_core_lines_when_asked(
    namespace: Namespace, tmp_path: Path
) -> None:
    with controller_in(
        namespace, tmp_path, cli_args=("--grpc-debug",), SHUTDOWN_TIMEOUT="1"
    ) as env:
        failed_handshake(env["GRPC"])
    assert CORE_NOISE in Path(env["LOG"]).read_text(errors="replace")


def failed_handshake(address: str) -> None:
    """A client that speaks plain HTTP to the TLS control port: a failed handshake there."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.recv(100)  # the controller closes it


# --- certificates gRPC could not verify (retried: they say which CA was expected) ------------


async def _first_retry(config: AgentConfig, caplog: pytest.LogCaptureFixture) -> str:
    """The first retried attempt's line of an agent session run with ``config``."""
    caplog.set_level(logging.WARNING, logger="agent.control.controller_channel")
    session = AgentSession(config, NullHandler())
    task = asyncio.create_task(session.run())
    try:
        async with asyncio.timeout(30):
            while not [r for r in caplog.records if "attempt 1 failed" in r.getMessage()]:
                await asyncio.sleep(0.05)
    finally:
        await session.stop()
        await asyncio.gather(task, return_exceptions=True)
    return next(r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage())


async def test_a_controller_set_up_anew_is_not_the_one_pinned_at_enrollment(
    ctl: RunningController, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """identity.json pins a CA this controller does not have (its var dir was wiped)."""
    old = load_or_create(tmp_path / "old-ca")
    data_dir = tmp_path / "agent"
    save_identity(
        data_dir,
        NodeIdentity.new(
            "11111111-2222-3333-4444-555555555555",
            "credential",
            f"127.0.0.1:{ctl.grpc_port}",
            "pinned",
            controller_ca_pem=old.ca_pem.decode(),
            tls_server_name=CONTROLLER_TLS_NAME,
        ),
    )
    line = await _first_retry(AgentConfig(data_dir=data_dir, node_name="pinned"), caplog)
    assert "the controller did not present the CA pinned at enrollment" in line, line
    assert "enroll again with a token it mints" in line


async def test_a_token_naming_no_ca_says_so_when_the_controller_is_not_trusted(
    ctl: RunningController, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A token minted without a CA (by a controller without TLS) against one with TLS: the
    system roots do not know the controller's CA."""
    token = _token()
    config = AgentConfig(
        data_dir=tmp_path / "agent",
        node_name="unpinned",
        controller_url=f"127.0.0.1:{ctl.grpc_port}",
        enrollment_token=token,
    )
    line = await _first_retry(config, caplog)
    assert "the enrollment token names no CA to pin" in line, line
    assert ctl.services.read_model.list_nodes() == []
