"""The capacity benchmark runs (small) against real Postgres and Redis and passes its checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_DATABASE_URL, TEST_REDIS_URL

pytestmark = pytest.mark.timeout(300)


def test_a_quick_capacity_run_relays_records_and_keeps_fifo(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.capacity",
            "--quick",
            "--database-url",
            TEST_DATABASE_URL,
            "--redis-url",
            TEST_REDIS_URL,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    [report_file] = tmp_path.glob("capacity-*.json")
    report = json.loads(report_file.read_text())
    assert report["failures"] == 0
    assert report["tokens_recorded"] == report["streams"] * report["tokens_per_stream"]
    assert report["tokens_relayed"] == report["tokens_recorded"]
    assert report["fifo_kept"] is True
    assert report["queued_jobs"] > 0  # the quick run oversubscribes too
    assert report["scheduler"]["p99_ms"] > 0
