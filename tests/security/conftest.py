"""Fixtures of the security suite: a network namespace of the test's own, and a controller
process listening inside it on a private address that exists only there (embedded SQLite
store, in-process live state, TLS with the CA it makes)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from interfaces.controller_main import RunningController, controller
from tests.conftest import TEST_DATABASE_URL, controller_settings
from tests.dacp_cli import run_dacp
from tests.faults.services import free_port
from tests.security.netns import Namespace, namespace_fixture

REPO = Path(__file__).resolve().parents[2]
AI_KEY = "test-ai-key"
ENROLLMENT_SECRET = "test-enrollment-secret"


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    """A controller on the defaults (TLS on), the tests' Postgres and Redis."""
    async with controller(controller_settings(pg_schema, tmp_path)) as running:
        yield running


async def dacp(schema: str, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``dacp ARGV`` on the test's store (Postgres schema ``schema``), as an operator runs it."""
    environment = {**os.environ, "DATABASE_URL": f"{TEST_DATABASE_URL}?schema={schema}", **env}
    return await asyncio.to_thread(run_dacp, *argv, env=environment)


namespace = namespace_fixture()


@contextlib.contextmanager
def controller_in(
    namespace: Namespace, tmp_path: Path, *, cli_args: tuple[str, ...] = (), **extra_env: str
) -> Iterator[dict[str, str]]:
    """A controller (``dacp controller CLI_ARGS``) serving HTTPS and gRPC on the namespace's
    address; yields its environment plus ``URL`` (HTTPS), ``GRPC`` (host:port), ``CA`` (the CA
    file) and ``LOG`` (its output)."""
    port, grpc_port = free_port(), free_port()
    var = tmp_path / f"var-{port}"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
        "HOST": namespace.inside,
        "PORT": str(port),
        "GRPC_HOST": namespace.inside,
        "GRPC_PORT": str(grpc_port),
        "AI_API_KEY": AI_KEY,
        "ADMIN_API_KEY": "test-admin-key",
        "NODE_ENROLLMENT_SECRET": ENROLLMENT_SECRET,
        "DACP_VAR_DIR": str(var),
        **extra_env,
    }
    log_path = var.parent / f"controller-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            namespace.command(sys.executable, "-m", "interfaces.cli.main", "controller", *cli_args),
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        ca = var / "tls" / "ca.pem"
        url = f"https://{namespace.inside}:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                trust = ssl.create_default_context(cafile=ca) if ca.exists() else None
                if trust and httpx.get(f"{url}/health", verify=trust, timeout=1).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        try:
            yield {
                **env,
                "URL": url,
                "GRPC": f"{namespace.inside}:{grpc_port}",
                "CA": str(ca),
                "LOG": str(log_path),
            }
        finally:
            proc.terminate()
            proc.wait(30)
