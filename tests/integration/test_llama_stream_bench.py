"""The stream-reading benchmark runs (small): both readers read every event of the stand-in's
streams, and the CPU each took per event is reported side by side."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_reports_both_readers() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.llama_stream", "--events", "40", "--rounds", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 0, run.stderr
    rows = dict(re.findall(r"^\s+(httpx|lean)\s+([\d.]+)", run.stdout, re.MULTILINE))
    assert set(rows) == {"httpx", "lean"}
    assert all(float(value) > 0 for value in rows.values())
    assert re.search(r"lean / httpx, paired per round: [\d.]+x", run.stdout)
