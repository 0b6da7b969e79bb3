"""Issue 21, finding 9: `/v1` is never open to the network by default.

A controller listening beyond loopback without ``AI_API_KEY`` refuses to start, with one line
on stderr and exit code 2, unless the operator says ``--open-api`` (or ``OPEN_API=true``): then
it serves, and warns at every start. With ``AI_API_KEY`` the key is required. Each controller
is a real ``dacp controller`` process in a network namespace the test creates, on a private
address that exists only there.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.faults.services import free_port
from tests.security.conftest import AI_KEY, REPO, controller_in
from tests.security.netns import Namespace

REFUSAL = "refusing to serve /v1"


def _v1_models(env: dict[str, str], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    trust = ssl.create_default_context(cafile=env["CA"])
    return httpx.get(f"{env['URL']}/v1/models", headers=headers, verify=trust, timeout=10)


def test_beyond_loopback_without_a_key_the_controller_refuses_to_start(
    namespace: Namespace, tmp_path: Path
) -> None:
    port = free_port()
    var = tmp_path / "var"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
        "HOST": namespace.inside,
        "PORT": str(port),
        "GRPC_HOST": namespace.inside,
        "GRPC_PORT": str(free_port()),
        "AI_API_KEY": "",
        "OPEN_API": "",
        "ADMIN_API_KEY": "test-admin-key",
        "DACP_VAR_DIR": str(var),
    }
    proc = subprocess.Popen(
        namespace.command(sys.executable, "-m", "interfaces.cli.main", "controller"),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url, ca = f"https://{namespace.inside}:{port}", var / "tls" / "ca.pem"
    served: httpx.Response | None = None
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if ca.exists():
                    trust = ssl.create_default_context(cafile=ca)
                    served = httpx.get(f"{url}/v1/models", verify=trust, timeout=1)
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.terminate()
        stdout, stderr = proc.communicate(timeout=30)
    assert served is None, (
        f"the controller served /v1 to anyone: {served.status_code} {served.text}"
    )
    assert proc.returncode == 2, (proc.returncode, stderr)
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    [line] = lines
    assert line.startswith(f"dacp: {REFUSAL} on {namespace.inside}"), line
    assert "AI_API_KEY" in line and "--open-api" in line and "OPEN_API=true" in line
    assert "Traceback" not in stderr


def test_with_open_api_it_serves_anyone_and_says_so(namespace: Namespace, tmp_path: Path) -> None:
    with controller_in(namespace, tmp_path, cli_args=("--open-api",), AI_API_KEY="") as env:
        answer = _v1_models(env)
        assert answer.status_code == 200, answer.text
        log = Path(env["LOG"]).read_text()
    assert "--open-api" in log and "/v1" in log and "WARNING" in log, log
    assert REFUSAL not in log


def test_open_api_env_is_the_flags_equivalent(namespace: Namespace, tmp_path: Path) -> None:
    with controller_in(namespace, tmp_path, AI_API_KEY="", OPEN_API="true") as env:
        assert _v1_models(env).status_code == 200


def test_with_an_ai_key_beyond_loopback_the_key_is_required(
    namespace: Namespace, tmp_path: Path
) -> None:
    with controller_in(namespace, tmp_path) as env:
        assert env["AI_API_KEY"] == AI_KEY
        missing = _v1_models(env)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "missing_api_key"
        assert _v1_models(env, "not-the-key").status_code == 401
        assert _v1_models(env, AI_KEY).status_code == 200
        log = Path(env["LOG"]).read_text()
    assert "--open-api" not in log
