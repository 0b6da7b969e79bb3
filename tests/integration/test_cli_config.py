"""One configuration, one cluster: ``dacp controller`` writes the config file at its first
start, and ``dacp`` in another shell (another directory, none of the controller's environment)
reaches that controller through its admin API, says so, and never creates a CA or a store of its
own. Real processes, as an operator runs them; SQLite, the embedded default."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from domain.enrollment_token import verify_token
from infrastructure.tls import fingerprint_of
from tests.dacp_cli import run_dacp, stop_process
from tests.integration.fake_control_plane import free_port

REPO = Path(__file__).resolve().parents[2]
#: What the operator's second shell does not have: the controller's environment.
CONTROLLER_ONLY = (
    "DATABASE_URL",
    "REDIS_URL",
    "ADMIN_API_KEY",
    "AI_API_KEY",
    "NODE_ENROLLMENT_SECRET",
    "DACP_VAR_DIR",
    "DACP_CONFIG",
    "DACP_URL",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "PORT",
    "GRPC_PORT",
    "MODEL_STORE_PORT",
)
SHA = "ab" * 32


def shell(home: Path) -> dict[str, str]:
    """A new shell of an operator whose home is ``home``."""
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLER_ONLY}
    return {**env, "HOME": str(home)}


def dacp(env: dict[str, str], cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return run_dacp(*argv, env={**env, "PYTHONPATH": str(REPO)}, cwd=cwd)


@contextlib.contextmanager
def controller(env: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    cwd.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "interfaces.cli.main", "controller"],
            env={**env, "PYTHONPATH": str(REPO)},
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        url = f"http://127.0.0.1:{env['PORT']}/health"
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield proc
    finally:
        stop_process(proc, signal.SIGINT, 30)


def test_a_second_shell_uses_the_running_controller(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    first = {**shell(home), "PORT": str(port), "GRPC_PORT": str(free_port())}
    first["MODEL_STORE_PORT"] = "0"
    config = home / ".config" / "dacp" / "config.toml"
    state = home / ".local" / "share" / "dacp"
    log = tmp_path / "controller.log"
    with controller(first, tmp_path / "shell-1", log):
        said = log.read_text()
        assert f"first start: wrote {config} (mode 0600)" in said, said
        assert "generated ADMIN_API_KEY and NODE_ENROLLMENT_SECRET there" in said
        assert stat.S_IMODE(config.stat().st_mode) == 0o600
        written = tomllib.loads(config.read_text())
        assert written["DACP_URL"] == f"http://127.0.0.1:{port}"
        assert written["DACP_VAR_DIR"] == str(state)
        admin = {"Authorization": f"Bearer {written['ADMIN_API_KEY']}"}

        second, elsewhere = shell(home), tmp_path / "shell-2"
        done = dacp(
            second, elsewhere, "models", "register", "m1", "--sha256", SHA, "--file-name", "m.gguf"
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines() == [
            f"dacp: used the controller at http://127.0.0.1:{port} (DACP_URL from {config})"
        ]
        models = httpx.get(f"http://127.0.0.1:{port}/api/admin/models", headers=admin).json()
        assert [m["name"] for m in models["data"]] == ["m1"]

        minted = dacp(second, elsewhere, "token", "create", "--json", "--node-name", "gpu-1")
        assert minted.returncode == 0, minted.stderr
        token = orjson.loads(minted.stdout)["token"]
        exported = dacp(second, elsewhere, "ca", "export")
        assert exported.returncode == 0, exported.stderr
        assert exported.stdout.encode() == (state / "tls" / "ca.pem").read_bytes()
        claims = verify_token(
            written["NODE_ENROLLMENT_SECRET"].encode(), token, time.time(), "gpu-1"
        )
        assert claims.ca_fingerprint == fingerprint_of(exported.stdout.encode())

        events = dacp(second, elsewhere, "token", "list")
        assert events.returncode == 0, events.stderr
        assert events.stderr.splitlines() == [
            f"dacp: used the event store SQLite in {state} (DACP_VAR_DIR from {config})"
        ]
        assert orjson.loads(minted.stdout)["token_id"] in events.stdout

    # The controller has stopped: the CLI says where it looked, and --store is the way round.
    refused = dacp(second, elsewhere, "token", "create")
    assert refused.returncode == 2 and refused.stdout == ""
    [line] = refused.stderr.splitlines()
    assert f"cannot reach the controller at http://127.0.0.1:{port}" in line and "--store" in line
    direct = dacp(second, elsewhere, "token", "create", "--store", "--json")
    assert direct.returncode == 0, direct.stderr
    assert "used the event store SQLite in" in direct.stderr
    for cwd in (tmp_path / "shell-1", elsewhere):
        assert list(cwd.iterdir()) == [], "nothing depends on the current directory"


def test_no_cli_command_creates_a_ca_or_a_store(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    env = shell(home)
    export = dacp(env, cwd, "ca", "export")
    assert export.returncode == 2
    assert "no controller CA in" in export.stderr and "dacp controller" in export.stderr
    unconfigured = dacp(env, cwd, "token", "create")
    assert unconfigured.returncode == 2
    [line] = unconfigured.stderr.splitlines()
    assert "no controller is configured" in line and "DACP_URL" in line
    stored = dacp(env, cwd, "token", "create", "--store")
    assert stored.returncode == 2 and "no controller CA in" in stored.stderr
    listing = dacp(env, cwd, "events", "node", "x")
    assert listing.returncode == 2 and "no event store at" in listing.stderr
    assert not any(p.name == "tls" for p in tmp_path.rglob("*")), "a CA was created"
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("command", [("token", "create"), ("models", "pull", "m", "--nodes", "a")])
def test_a_controller_url_in_the_environment_wins_over_the_file(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    home = tmp_path / "home"
    config = home / ".config" / "dacp" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'DACP_URL = "http://127.0.0.1:{free_port()}"\n')
    other = f"http://127.0.0.1:{free_port()}"
    done = dacp({**shell(home), "DACP_URL": other}, tmp_path, *command)
    assert done.returncode == 2 and f"cannot reach the controller at {other}" in done.stderr
