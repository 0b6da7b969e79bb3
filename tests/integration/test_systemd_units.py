"""The systemd units in ops/systemd: systemd itself finds nothing wrong with them
(``systemd-analyze verify``), their hardening keeps a low exposure score (``systemd-analyze
security``), they stop the processes gracefully within their stop timeout, they put state where
the README says, and their environment template names only variables the code reads."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.agent_config import DEFAULT_DRAIN_TIMEOUT
from infrastructure.config_file import SYSTEM_CONFIG
from infrastructure.settings import DEFAULT_SHUTDOWN_TIMEOUT
from interfaces.controller_main import STOP_TASKS_TIMEOUT
from interfaces.controller_shutdown import END_GRACE, STOP_SIGNALS
from tests.integration.source_tree import REPO, tracked_files

UNITS_DIR = REPO / "ops" / "systemd"
CONTROLLER_UNIT = UNITS_DIR / "dacp-controller.service"
AGENT_UNIT = UNITS_DIR / "dacp-agent.service"
UNITS = (CONTROLLER_UNIT, AGENT_UNIT)
ENV_TEMPLATE = UNITS_DIR / "dacp.env.example"
SYSUSERS = UNITS_DIR / "dacp.sysusers"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
#: ``systemd-analyze security``'s exposure (0-10; "OK" is below 4.5) each unit stays under.
MAX_EXPOSURE = 2.5
#: What an agent needs beyond its drain to say goodbye and stop its llama.cpp servers (s).
AGENT_STOP_MARGIN = 20.0
#: What verify may say about this machine rather than the unit: the user it runs as need not
#: exist where the test runs.
_HOST_ONLY = re.compile(r"(user|group) .*dacp|dacp.*(user|group)", re.IGNORECASE)


def _directives(unit: Path) -> dict[str, list[str]]:
    """Each ``Key=value`` of the unit's sections, all the values of a repeated key in order."""
    found: dict[str, list[str]] = {}
    for line in unit.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def _one(unit: Path, key: str) -> str:
    values = _directives(unit)[key]
    assert len(values) == 1, f"{unit.name}: {key} set {len(values)} times"
    return values[0]


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)\s*(s|min)?", value)
    assert match, f"not a plain time span: {value!r}"
    return float(match[1]) * (60 if match[2] == "min" else 1)


def _runnable_copy(unit: Path, dest: Path) -> Path:
    """The unit with its ExecStart's program replaced by one that exists here (verify checks
    that it is executable): the venv the units name is not installed on this machine."""
    exec_start = _one(unit, "ExecStart")
    program = exec_start.split()[0]
    assert program.startswith("/opt/dacp/bin/"), exec_start
    text = unit.read_text(encoding="utf-8").replace(
        f"ExecStart={program}", f"ExecStart={shutil.which('true')}"
    )
    copy = dest / unit.name
    copy.write_text(text, encoding="utf-8")
    return copy


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_verify_finds_nothing(unit: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", str(_runnable_copy(unit, tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not _HOST_ONLY.search(line)
    ]
    assert result.returncode == 0 and said == [], (
        f"systemd-analyze verify {unit.name} (exit {result.returncode}):\n"
        + result.stdout
        + result.stderr
    )


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_hardening_keeps_the_exposure_low(unit: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *(SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager"),
            f"--threshold={round(MAX_EXPOSURE * 10)}",
            str(_runnable_copy(unit, tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, (
        f"{unit.name}: exposure above {MAX_EXPOSURE}:\n{result.stdout[-4000:]}{result.stderr}"
    )
    for key in ("NoNewPrivileges", "PrivateTmp"):
        assert _one(unit, key) == "yes"
    assert _one(unit, "ProtectSystem") == "strict"


def test_the_controller_stops_within_its_stop_timeout() -> None:
    unit = CONTROLLER_UNIT
    assert _one(unit, "KillSignal").removeprefix("SIG") in {
        s.removeprefix("SIG") for s in STOP_SIGNALS
    }
    # The signal reaches the controller alone; what it waits for is bounded by its settings.
    assert _one(unit, "KillMode") == "mixed"
    longest = DEFAULT_SHUTDOWN_TIMEOUT + 2 * END_GRACE + STOP_TASKS_TIMEOUT
    assert _seconds(_one(unit, "TimeoutStopSec")) >= longest


def test_the_agent_drains_before_systemd_kills_it() -> None:
    unit = AGENT_UNIT
    # The agent drains on SIGINT and SIGTERM alike; only it gets the signal, not the llama.cpp
    # servers whose jobs it waits for.
    assert _one(unit, "KillSignal") in ("SIGTERM", "SIGINT")
    assert _one(unit, "KillMode") == "mixed"
    timeout = _seconds(_one(unit, "TimeoutStopSec"))
    assert timeout >= DEFAULT_DRAIN_TIMEOUT + AGENT_STOP_MARGIN


def test_the_agent_keeps_the_gpus() -> None:
    """Each of these would leave the agent (and its llama.cpp servers) no GPU device: a private
    /dev, or a device allow-list (ProtectClock= implies one, holding the clock only)."""
    directives = _directives(AGENT_UNIT)
    for key in ("PrivateDevices", "ProtectClock", "DeviceAllow", "DevicePolicy"):
        assert key not in directives, f"{AGENT_UNIT.name} sets {key}"


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_units_restart_on_failure_but_not_on_a_configuration_error(unit: Path) -> None:
    assert _one(unit, "Restart") == "on-failure"
    assert _one(unit, "RestartPreventExitStatus") == "2"  # the CLIs' usage/configuration exit


def test_state_goes_where_the_units_keep_it() -> None:
    controller = _directives(CONTROLLER_UNIT)
    environment = dict(
        pair.split("=", 1) for line in controller["Environment"] for pair in line.split()
    )
    state = f"/var/lib/{_one(CONTROLLER_UNIT, 'StateDirectory')}"
    assert environment["DACP_VAR_DIR"] == state
    assert _one(CONTROLLER_UNIT, "WorkingDirectory") == state
    # The config file the CLI reads on a system install, beside the environment file; the
    # controller may write it there at its first start.
    config_dir = f"/etc/{_one(CONTROLLER_UNIT, 'ConfigurationDirectory')}"
    assert environment["DACP_CONFIG"] == str(SYSTEM_CONFIG)
    assert SYSTEM_CONFIG.parent == Path(config_dir)
    assert Path(_one(CONTROLLER_UNIT, "EnvironmentFile")).parent == Path(config_dir)
    assert config_dir in _one(CONTROLLER_UNIT, "ReadWritePaths").split()

    agent_state = f"/var/lib/{_one(AGENT_UNIT, 'StateDirectory')}"
    exec_start = _one(AGENT_UNIT, "ExecStart").split()
    assert exec_start[exec_start.index("--data-dir") + 1] == agent_state
    assert _one(AGENT_UNIT, "Environment") == (
        f"DACP_CACHE_DIR=/var/cache/{_one(AGENT_UNIT, 'CacheDirectory')}"
    )
    assert state != agent_state  # a machine may run both


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_units_run_as_the_user_sysusers_creates(unit: Path) -> None:
    users = [line.split()[1] for line in SYSUSERS.read_text().splitlines() if line[:2] == "u "]
    assert _one(unit, "User") in users
    assert _one(unit, "EnvironmentFile") == "/etc/dacp/dacp.env"


def _template_keys() -> dict[str, str]:
    keys: dict[str, str] = {}
    for line in ENV_TEMPLATE.read_text(encoding="utf-8").splitlines():
        match = re.fullmatch(r"#?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            keys[match[1]] = match[2]
    return keys


def test_the_env_template_names_only_variables_something_reads() -> None:
    keys = _template_keys()
    assert "DACP_CONTROLLER_URL" in keys and "HOST" in keys
    sources = "\n".join(
        (REPO / path).read_text(encoding="utf-8", errors="replace")
        for path in tracked_files()
        if path.suffix == ".py" and path.parts[0] not in ("tests", "bench")
    )
    agent_exec = _one(AGENT_UNIT, "ExecStart")
    unread = [
        key
        for key in keys
        if f'"{key}"' not in sources and f"${key}" not in agent_exec.replace("${", "$")
    ]
    assert unread == []


def test_the_env_template_holds_no_secret() -> None:
    for key, value in _template_keys().items():
        if re.search(r"KEY|SECRET|TOKEN|PASSWORD", key):
            assert re.fullmatch(r"<[^>]*>", value), f"{key} has a value in the template: {value}"
    for line in ENV_TEMPLATE.read_text(encoding="utf-8").splitlines():
        assert not re.match(r"[A-Z]", line), f"set, not a placeholder: {line}"
