"""The wheel installs like software: ``pip install`` of it into a fresh venv gives working
``dacp`` and ``node-agent`` commands, and a controller and an agent run from that venv alone
(outside the checkout, with a clean environment) start, enroll and answer a chat completion
with real llama.cpp (the build cache's, as an installed node uses it).

The venv is made without pip and filled by this venv's pip (``pip --python``), from the package
index pip is configured with: the wheel's dependencies are resolved as an operator's install
resolves them. About 25 s here, most of it unpacking the dependencies' wheels.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import tomllib
import venv
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from ops import artifacts, paths
from ops.local_cluster import MODEL_NAME
from tests.integration.source_tree import REPO, build_wheel, copy_source_tree, tracked_files

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

#: How long a process from the venv may take to come up, and to stop (s).
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0
NODE_NAME = "wheel-node"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = copy_source_tree(tmp_path_factory.mktemp("src"))
    return build_wheel(source, tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its dependencies installed; its bin/ folder."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install"),
            *("--disable-pip-version-check", "--progress-bar", "off", str(wheel)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"pip install of {wheel.name} failed:\n{result.stdout[-3000:]}"
    return root / "bin"


def _clean_env(home: Path, **values: str) -> dict[str, str]:
    """No checkout, venv, store or config of the test run leaks in: only what is named here."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "XDG_CONFIG_HOME": str(home / ".config"),
        **values,
    }


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _package_names() -> set[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    packages: list[str] = pyproject["tool"]["setuptools"]["packages"]
    return {name.split(".")[0] for name in packages}


def test_the_wheel_holds_every_file_of_its_packages(wheel: Path) -> None:
    """Whatever is checked in under a package (code, the dashboard and its vendored library,
    proto sources and stubs, the accept filter's C source, the systemd units) is installed."""
    packages = _package_names()
    expected = {
        relative.as_posix()
        for relative in tracked_files()
        if relative.parts[0] in packages and "__pycache__" not in relative.parts
    }
    names = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(expected - names) == []
    assert (
        "interfaces/http/admin/static/dashboard.html" in names
    )  # the check above saw the packages


def test_installed_commands_answer(installed: Path, tmp_path: Path) -> None:
    env = _clean_env(tmp_path)
    for argv, shows in (
        ([str(installed / "dacp"), "--help"], "controller"),
        ([str(installed / "node-agent"), "--help"], "--controller-url"),
        ([str(installed / "node-agent"), "--version"], "0.1.0"),
        # How a node builds llama.cpp from the installed package (README, "Install as a service").
        ([str(installed / "python"), "-m", "ops.build_llama", "--help"], "--backend"),
    ):
        result = _run(argv, env, tmp_path)
        assert result.returncode == 0, f"{argv}: {result.stderr}"
        assert shows in result.stdout, result.stdout
    # The code and the files it reads at run time come from the venv, not the checkout.
    probe = _run(
        [
            str(installed / "python"),
            "-c",
            "import agent.runtime.rpc_filter as f, interfaces.http.admin.operations_api as o, ops,"
            " wire.control_pb2;"
            "print(o.STATIC_DIR); print(f.ACCEPT_FILTER_SOURCE.is_file()); print(ops.__file__)",
        ],
        env,
        tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    static_dir, has_filter_source, ops_file = probe.stdout.split()
    venv_root = installed.parent.resolve()
    assert Path(static_dir).resolve().is_relative_to(venv_root)
    assert Path(ops_file).resolve().is_relative_to(venv_root)
    assert has_filter_source == "True"


class _Process:
    """A command from the venv in the background, its output in a file."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, f"exited ({self.popen.returncode}):\n{self.output()}"
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}:\n{self.output()}")

    def stop(self) -> int:
        """SIGTERM, as systemd stops a unit; its exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            pytest.fail(f"did not stop within {STOP_TIMEOUT:.0f} s of SIGTERM:\n{self.output()}")


@pytest.fixture
def processes() -> Iterator[list[_Process]]:
    started: list[_Process] = []
    yield started
    for process in reversed(started):
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()


def test_installed_controller_and_agent_serve_a_completion(
    installed: Path, tmp_path: Path, processes: list[_Process]
) -> None:
    """As the systemd units run them: the controller with its state directory (SQLite, its CA)
    and a config file it writes at its first start, then `dacp` commands that find everything
    in that file, an agent enrolling with the token they minted and serving the model they
    registered, then SIGTERM to each."""
    artifacts.ensure_llama()
    model = artifacts.ensure_model()
    state = tmp_path / "state"
    config = tmp_path / "etc" / "config.toml"
    port = _free_port()
    grpc_port = _free_port()
    env = _clean_env(
        tmp_path,
        DACP_VAR_DIR=str(state),
        DACP_CONFIG=str(config),
        PORT=str(port),
        GRPC_PORT=str(grpc_port),
        MODEL_STORE_PORT="0",
    )
    controller = _Process(
        [str(installed / "dacp"), "controller", "--log-level", "info"],
        env,
        tmp_path,
        tmp_path / "controller.log",
    )
    processes.append(controller)
    url = f"http://127.0.0.1:{port}"
    controller.wait_for("/health", lambda: httpx.get(f"{url}/health", timeout=2).is_success)

    # The dashboard and its vendored chart library are served from the installed package.
    page = httpx.get(f"{url}/dashboard", timeout=5)
    assert page.status_code == 200 and "<html" in page.text.lower()
    chart = httpx.get(f"{url}/dashboard/static/vendor/uplot/uPlot.iife.min.js", timeout=5)
    assert chart.status_code == 200 and "uPlot" in chart.text

    # The first start wrote the config file every dacp command reads (mode 0600).
    assert config.stat().st_mode & 0o777 == 0o600
    admin_key = tomllib.loads(config.read_text(encoding="utf-8"))["ADMIN_API_KEY"]
    cli_env = {k: v for k, v in env.items() if k not in ("PORT", "GRPC_PORT")}
    ca = _run([str(installed / "dacp"), "ca", "export"], cli_env, tmp_path)
    assert ca.returncode == 0, ca.stderr
    assert ca.stdout.startswith("-----BEGIN CERTIFICATE-----")
    minted = _run(
        [str(installed / "dacp"), "token", "create", "--single-use", "--node-name", NODE_NAME],
        cli_env,
        tmp_path,
    )
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip().splitlines()[-1]

    models_dir = tmp_path / "agent-models"
    models_dir.mkdir()
    (models_dir / model.name).symlink_to(model)
    agent = _Process(
        [
            str(installed / "node-agent"),
            *("--controller-url", f"127.0.0.1:{grpc_port}"),
            *("--enrollment-token", token),
            *("--node-name", NODE_NAME),
            *("--data-dir", str(tmp_path / "agent")),
            *("--models-dir", str(models_dir)),
            *("--advertise-address", "127.0.0.1", "--rpc-port", str(_free_port())),
            *("--transfer-port", "0", "--heartbeat-interval", "1"),
        ],
        _clean_env(tmp_path, DACP_CACHE_DIR=str(paths.cache_dir())),
        tmp_path,
        tmp_path / "agent.log",
    )
    processes.append(agent)

    def enrolled() -> bool:
        rows = httpx.get(
            f"{url}/api/admin/nodes",
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=2,
        ).json()["data"]
        return any(r["name"] == NODE_NAME and r["state"] == "READY" for r in rows)

    agent.wait_for(f"{NODE_NAME} READY at the controller", enrolled)
    assert (tmp_path / "agent" / "identity.json").is_file()

    registered = _run(
        [
            *(str(installed / "dacp"), "models", "register", MODEL_NAME),
            *("--sha256", paths.MODEL_SHA256, "--file-name", model.name),
        ],
        cli_env,
        tmp_path,
    )
    assert registered.returncode == 0, registered.stderr
    completion = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
        },
        timeout=120,
    )
    assert completion.status_code == 200, f"{completion.text}\n{agent.output()[-3000:]}"
    assert completion.json()["usage"]["completion_tokens"] > 0

    assert agent.stop() == 0, agent.output()
    assert controller.stop() == 0, controller.output()
    assert "Traceback" not in controller.output() + agent.output()
