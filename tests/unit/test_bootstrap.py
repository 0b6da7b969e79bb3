"""ops.bootstrap: first-run steps run side by side, with prefixed output and a clear failure."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from ops import bootstrap


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_steps_run_at_the_same_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Each step announces itself, then waits for the other: only concurrent steps both finish.
    wait_for = (
        "import pathlib, sys, time\n"
        "d = pathlib.Path(sys.argv[1]); (d / sys.argv[2]).touch()\n"
        "for _ in range(600):\n"
        "    if (d / sys.argv[3]).exists(): print('saw', sys.argv[3]); sys.exit(0)\n"
        "    time.sleep(0.05)\n"
        "sys.exit(3)\n"
    )
    steps = [
        bootstrap.Step("first", [*_py(wait_for), str(tmp_path), "a", "b"]),
        bootstrap.Step("second", [*_py(wait_for), str(tmp_path), "b", "a"]),
    ]
    assert bootstrap.run_parallel(steps)
    out = capsys.readouterr().out
    assert "[first]  saw b" in out
    assert "[second] saw a" in out
    assert all(step.code == 0 for step in steps)


def test_a_failing_step_is_named_with_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    steps = [
        bootstrap.Step("ok", _py("print('fine')")),
        bootstrap.Step(
            "broken", _py("print('step one'); print('cmake not found'); raise SystemExit(4)")
        ),
    ]
    assert not bootstrap.run_parallel(steps)
    broken = steps[1]
    assert broken.code == 4
    assert broken.tail[-1] == "cmake not found"
    assert "[broken] FAILED (exit 4)" in capsys.readouterr().out


def test_a_step_that_cannot_start_fails_cleanly() -> None:
    step = bootstrap.Step("missing", ["/nonexistent/tool"])
    assert not bootstrap.run_parallel([step])
    assert step.code == 127 and "cannot start" in step.tail[0]


def test_main_exits_1_and_names_the_failed_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        bootstrap,
        "plan",
        lambda target, only=(): [bootstrap.Step("model", _py("raise SystemExit(2)"))],
    )
    assert bootstrap.main(["demo"]) == 1
    assert "set-up failed: model exited 2" in capsys.readouterr().out


def test_compile_starts_first_and_browser_only_for_tests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bootstrap, "venv_is_current", lambda extra: False)
    monkeypatch.setattr(bootstrap, "CHROMIUM", Path("/nonexistent/chromium"))
    monkeypatch.setattr(bootstrap, "NODE_SDK_DIR", tmp_path)  # no node_modules there
    demo = [step.name for step in bootstrap.plan("demo")]
    test = [step.name for step in bootstrap.plan("test")]
    assert demo == ["llama.cpp", "venv", "model"]
    assert test == ["llama.cpp", "venv", "model", "browser", "node-sdk"]
    assert [s.name for s in bootstrap.plan("test", only=["model"])] == ["model"]
    assert bootstrap.plan("demo")[1].argv[-1] == "demo"
    assert bootstrap.plan("test")[1].argv[-1] == "dev"


def test_node_sdk_step_runs_npm_ci_until_node_modules_is_newer_than_the_lock(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bootstrap, "NODE_SDK_DIR", tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    lock = tmp_path / "package-lock.json"
    installed = tmp_path / "node_modules" / ".package-lock.json"
    lock.write_text("{}")

    def node_sdk_steps() -> list[bootstrap.Step]:
        return [s for s in bootstrap.plan("test", only=["node-sdk"]) if s.name == "node-sdk"]

    [step] = node_sdk_steps()  # never installed
    assert step.argv == ["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(tmp_path)]
    installed.parent.mkdir()
    installed.write_text("{}")
    os.utime(lock, (1_000, 1_000))
    os.utime(installed, (2_000, 2_000))
    assert node_sdk_steps() == []  # installed after the lock last changed: skipped
    os.utime(installed, (1_000, 1_000))
    assert node_sdk_steps() == []  # `npm install` gives both the same mtime
    os.utime(lock, (3_000, 3_000))
    assert [s.name for s in node_sdk_steps()] == ["node-sdk"]  # the lock moved on: reinstall
    assert bootstrap.plan("demo", only=["node-sdk"]) == []  # only `make test` needs it


def test_node_sdk_step_without_npm_fails_with_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bootstrap, "NODE_SDK_DIR", tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bootstrap.main(["test", "--only", "node-sdk"]) == 1
    out = capsys.readouterr().out
    assert "set-up failed: node-sdk exited 1: npm not found: Node.js 20+ and npm are needed" in out


def test_nothing_to_do_is_a_success(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bootstrap, "plan", lambda target, only=(): [])
    assert bootstrap.main(["test"]) == 0
    assert "everything is in place" in capsys.readouterr().out


def test_venv_stamp_tracks_pyproject_and_extras(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bootstrap, "VENV", tmp_path)
    stamp = tmp_path / bootstrap.STAMP_NAME
    assert not bootstrap.venv_is_current("demo")
    stamp.write_text(json.dumps({"pyproject": bootstrap._pyproject_digest(), "extras": ["demo"]}))
    assert bootstrap.venv_is_current("demo")
    assert not bootstrap.venv_is_current("dev")  # `make test` after `make demo` installs more
    stamp.write_text(json.dumps({"pyproject": bootstrap._pyproject_digest(), "extras": ["dev"]}))
    assert bootstrap.venv_is_current("demo")  # dev is a superset of demo
    stamp.write_text(json.dumps({"pyproject": "stale", "extras": ["dev"]}))
    assert not bootstrap.venv_is_current("dev")


def test_dev_extra_contains_the_demo_extra() -> None:
    """venv_is_current treats a dev venv as good for the demo; pyproject must keep that true."""
    import tomllib

    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["demo"]) <= set(extras["dev"])
