"""The README's LAN quick start, run as written, across two network namespaces joined by a
veth pair: the controller's machine (10.0.0.5: the controller in one shell, the CLI in a second
shell that shares no environment with it) and a node (10.0.0.21: the agent). The addresses exist
only inside the test. Each command is checked to be the README's own, then run with its
placeholders filled in; a streamed chat completion then crosses the LAN over HTTPS, trusting
the CA that `dacp ca export` printed. Real llama.cpp, the embedded defaults (SQLite)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ops import paths
from tests.dacp_cli import stop_process
from tests.security.netns import ip

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
CONTROLLER_IP, NODE_IP = "10.0.0.5", "10.0.0.21"
KEY = "test-lan-api-key"

SHELL_1 = "HOST=10.0.0.5 GRPC_HOST=10.0.0.5 AI_API_KEY=YOUR_API_KEY .venv/bin/dacp controller"
SHELL_2 = (
    ".venv/bin/dacp token create --ttl 3600 --node-name gpu-box-1",
    ".venv/bin/dacp models add /path/to/SmolLM2-135M-Instruct.Q4_1.gguf --name smollm2-135m",
    ".venv/bin/dacp ca export > dacp-ca.pem",
    "ADMIN_API_KEY=$(sed -n 's/^ADMIN_API_KEY = \"\\(.*\\)\"/\\1/p' ~/.config/dacp/config.toml)\n"
    "curl -s --cacert dacp-ca.pem https://10.0.0.5:8000/api/admin/nodes \\\n"
    '  -H "Authorization: Bearer $ADMIN_API_KEY"',
)
NODE = (
    ".venv/bin/node-agent --foreground --controller-url 10.0.0.5:50051 \\\n"
    "  --enrollment-token YOUR_ENROLLMENT_TOKEN --node-name gpu-box-1 \\\n"
    "  --advertise-address 10.0.0.21 --models-dir /srv/models"
)
#: What the shells inherit from the test's own environment: nothing of the cluster's.
NOT_INHERITED = ("DATABASE_URL", "REDIS_URL", "ADMIN_API_KEY", "AI_API_KEY", "DACP_CONFIG")


@dataclass
class Lan:
    """Two namespaces, ``controller`` and ``node``, on one /24 joined by a veth pair."""

    controller: str
    node: str

    @classmethod
    @contextlib.contextmanager
    def create(cls) -> Iterator[Lan]:
        tag = uuid.uuid4().hex[:6]
        lan = cls(f"dacp-ctl-{tag}", f"dacp-node-{tag}")
        try:
            ip("netns", "add", lan.controller)
            ip("netns", "add", lan.node)
            ip("link", "add", f"lc{tag}", "type", "veth", "peer", "name", f"ln{tag}")
            for ns, link, address in (
                (lan.controller, f"lc{tag}", CONTROLLER_IP),
                (lan.node, f"ln{tag}", NODE_IP),
            ):
                ip("link", "set", link, "netns", ns)
                ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
                ip("-n", ns, "link", "set", link, "up")
                ip("-n", ns, "link", "set", "lo", "up")
            yield lan
        finally:
            for ns in (lan.controller, lan.node):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def as_run(command: str, **fill: str) -> str:
    """The README's ``command`` with its placeholders filled in and the venv made absolute."""
    assert command in README, f"the README no longer says:\n{command}"
    for placeholder, value in fill.items():
        command = command.replace(placeholder, value)
    return command.replace(".venv/bin/", f"{REPO}/.venv/bin/")


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def in_shell(
    ns: str, command: str, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "bash", "-c", command],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@contextlib.contextmanager
def background(ns: str, command: str, env: dict[str, str], cwd: Path, log: Path) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, "bash", "-c", command],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield
    finally:
        stop_process(proc, signal.SIGTERM, 60)


def until(what: str, check: Callable[[], bool], seconds: float, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s:\n{log.read_text()}"
        time.sleep(0.5)


def test_the_readmes_lan_quick_start_works_as_written(tmp_path: Path) -> None:
    home = tmp_path / "operator"  # a new operator: nothing configured yet
    shell_1, shell_2 = tmp_path / "shell-1", tmp_path / "shell-2"
    for folder in (home, shell_1, shell_2):
        folder.mkdir()
    operator = environment(HOME=str(home))
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "DACP_VAR_DIR", "DACP_URL"):
        operator.pop(name, None)
    log = tmp_path / "controller.log"
    with Lan.create() as lan:
        with background(lan.controller, as_run(SHELL_1, YOUR_API_KEY=KEY), operator, shell_1, log):
            config = home / ".config" / "dacp" / "config.toml"
            until("config file", config.exists, 60, log)

            def answers() -> bool:
                probe = in_shell(
                    lan.controller,
                    f"curl -sk https://{CONTROLLER_IP}:8000/health",
                    operator,
                    shell_2,
                )
                return '"status"' in probe.stdout

            until("controller", answers, 60, log)

            # Shell 2: none of shell 1's environment, another directory.
            steps = [in_shell(lan.controller, as_run(c), operator, shell_2) for c in SHELL_2[:1]]
            model = str(paths.model_path())
            steps.append(
                in_shell(
                    lan.controller,
                    as_run(SHELL_2[1], **{"/path/to/SmolLM2-135M-Instruct.Q4_1.gguf": model}),
                    operator,
                    shell_2,
                )
            )
            steps += [in_shell(lan.controller, as_run(c), operator, shell_2) for c in SHELL_2[2:]]
            for step in steps:
                assert step.returncode == 0, (step.args, step.stderr)
            token = steps[0].stdout.strip()
            assert "used the controller at https://10.0.0.5:8000" in steps[0].stderr
            assert steps[3].stdout.startswith('{"object":"list"'), steps[3]
            ca = shell_2 / "dacp-ca.pem"
            assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")

            # The node: another machine on the LAN.
            node_log = tmp_path / "agent.log"
            node_env = environment(XDG_DATA_HOME=str(tmp_path / "node-data"))
            node_command = as_run(
                NODE, YOUR_ENROLLMENT_TOKEN=token, **{"/srv/models": str(tmp_path / "models")}
            )
            with background(lan.node, node_command, node_env, tmp_path, node_log):
                chat = (
                    "import openai\n"
                    f"client = openai.OpenAI(base_url='https://{CONTROLLER_IP}:8000/v1', "
                    f"api_key={KEY!r})\n"
                    "stream = client.chat.completions.create(model='smollm2-135m', "
                    "messages=[{'role': 'user', 'content': 'Say hello.'}], max_tokens=12, "
                    "stream=True, temperature=0)\n"
                    "print(''.join(c.choices[0].delta.content or '' for c in stream "
                    "if c.choices), end='')\n"
                )
                app = environment(SSL_CERT_FILE=str(ca))
                streamed = subprocess.run(
                    ["ip", "netns", "exec", lan.node, sys.executable, "-c", chat],
                    env=app,
                    capture_output=True,
                    text=True,
                    timeout=180,
                )
                assert streamed.returncode == 0, (streamed.stderr, node_log.read_text())
                assert streamed.stdout.strip(), "an empty completion"
                nodes = in_shell(lan.controller, as_run(SHELL_2[3]), operator, shell_2)
                assert re.search(r'"name":"gpu-box-1".*"state":"(READY|BUSY)"', nodes.stdout)
