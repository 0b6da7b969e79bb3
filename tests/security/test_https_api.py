"""The HTTP API is HTTPS whenever the controller listens beyond loopback, with the certificate
its own CA issues; `dacp ca export` prints that CA, and the official OpenAI SDK trusts it
through `SSL_CERT_FILE`. The controller runs in a network namespace the test creates, on a
private address that exists only there (embedded SQLite store, in-process live state)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.faults.services import free_port
from tests.security.netns import Namespace

REPO = Path(__file__).resolve().parents[2]
AI_KEY = "test-ai-key"


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    ns = Namespace.create()
    yield ns
    ns.delete()


@pytest.fixture
def controller_in_namespace(namespace: Namespace, tmp_path: Path) -> Iterator[dict[str, str]]:
    port, grpc_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
        "HOST": namespace.inside,
        "PORT": str(port),
        "GRPC_HOST": namespace.inside,
        "GRPC_PORT": str(grpc_port),
        "AI_API_KEY": AI_KEY,
        "ADMIN_API_KEY": "test-admin-key",
        "NODE_ENROLLMENT_SECRET": "test-enrollment-secret",
        "DACP_VAR_DIR": str(tmp_path / "var"),
    }
    log = (tmp_path / "controller.log").open("wb")
    proc = subprocess.Popen(
        namespace.command(sys.executable, "-m", "interfaces.cli", "controller"),
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    ca = tmp_path / "var" / "tls" / "ca.pem"
    url = f"https://{namespace.inside}:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            trust = ssl.create_default_context(cafile=ca) if ca.exists() else None
            if trust and httpx.get(f"{url}/health", verify=trust, timeout=1).is_success:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (
            tmp_path / "controller.log"
        ).read_text()
        time.sleep(0.2)
    yield {**env, "URL": url, "CA": str(ca)}
    proc.terminate()
    proc.wait(30)
    log.close()


def test_beyond_loopback_the_api_is_https_with_the_controllers_ca(
    controller_in_namespace: dict[str, str], tmp_path: Path
) -> None:
    env, url = controller_in_namespace, controller_in_namespace["URL"]
    # Plain HTTP gets nowhere, and an unverified certificate is not trusted by default.
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/health", timeout=3)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=3)
    # `dacp ca export` prints the very CA the server's certificate chains to.
    exported = subprocess.run(
        [sys.executable, "-m", "interfaces.cli", "ca", "export"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert exported == Path(env["CA"]).read_text()
    ca_file = tmp_path / "exported-ca.pem"
    ca_file.write_text(exported)
    # The official SDK, trusting it the way the README says (SSL_CERT_FILE).
    script = (
        "import openai, sys\n"
        f"client = openai.OpenAI(base_url={url + '/v1'!r}, api_key={AI_KEY!r})\n"
        "print(sorted(m.id for m in client.models.list()))\n"
    )
    listed = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "SSL_CERT_FILE": str(ca_file)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == "[]"
