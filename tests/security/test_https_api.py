"""The HTTP API is HTTPS whenever the controller listens beyond loopback, with the certificate
its own CA issues; `dacp ca export` prints that CA, and the official OpenAI SDK trusts it
through `SSL_CERT_FILE`. The controller runs in a network namespace the test creates, on a
private address that exists only there (embedded SQLite store, in-process live state)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.security.conftest import AI_KEY, REPO, controller_in
from tests.security.netns import Namespace


@pytest.fixture
def controller_in_namespace(namespace: Namespace, tmp_path: Path) -> Iterator[dict[str, str]]:
    with controller_in(namespace, tmp_path) as env:
        yield env


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
        [sys.executable, "-m", "interfaces.cli.main", "ca", "export"],
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
