"""The hot-path benchmark runs (small): the controller's added time to first token against a
stand-in server, with a baseline controller of another checkout side by side (this one again,
so both must work and their difference is measured per round), and the controller asked
with a managed key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_measures_both_controllers_against_direct(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.hot_path",
            "--rounds",
            "6",
            "--pause",
            "0",
            "--baseline",
            str(ROOT),
            "--managed-key",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    [report_file] = tmp_path.glob("hot-path-*.json")
    report = json.loads(report_file.read_text())
    assert report["failures"] == 0
    assert set(report["paths"]) == {"controller", "baseline", "managed"}
    # The managed path asks the same controller: its CPU is the controller's, not its own.
    assert report["paths"]["managed"]["controller_cpu_ms_per_request"] is None
    assert report["paths"]["controller"]["controller_cpu_ms_per_request"] > 0
    first_token_ms = report["first_token_ms"]
    assert report["direct_ms"]["p50"] >= first_token_ms
    for path in report["paths"].values():
        assert path["ttft_ms"]["p50"] >= first_token_ms  # the agent waits that long too
        assert path["added_ms"]["p50"] > 0  # a controller costs something over direct
    assert "p50" in report["controller_minus_baseline_ms"]
    assert "controller - baseline (paired)" in run.stdout
    assert "p50" in report["managed_minus_controller_ms"]
    assert "managed - controller (paired)" in run.stdout


def test_a_baseline_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.hot_path", "--baseline", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode == 2
    assert "not a checkout of this project" in run.stderr
