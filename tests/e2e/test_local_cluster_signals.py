"""The local cluster shuts down completely on SIGINT, SIGTERM and SIGHUP (exit 0), and a
SIGKILL of the cluster process takes the controller, the agents and llama.cpp with it.

Each case starts ``python -m ops.local_cluster`` as a real process, runs one completion so that
``llama-server`` and both ``ggml-rpc-server``s exist, records every descendant process, sends the
signal and then checks that none of them is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ops import artifacts
from ops.local_cluster import MODEL_NAME

pytestmark = pytest.mark.timeout(300)
READY_LINE = "stops the cluster"
AI_KEY = "signal-test-ai-key"
ADMIN_KEY = "signal-test-admin-key"


def _wait_for_line(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if needle in text:
            return text
        if proc.poll() is not None:
            raise AssertionError(f"local cluster exited {proc.returncode} early:\n{text[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {needle!r} within {timeout} s:\n{log.read_text(errors='replace')}")


@pytest.fixture
def cluster_process(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[bytes], Path, list[psutil.Process]]]:
    artifacts.ensure_llama()
    artifacts.ensure_model()
    log = tmp_path / "cluster.out"
    env = {**os.environ, "AI_API_KEY": AI_KEY, "ADMIN_API_KEY": ADMIN_KEY}
    with log.open("wb") as out:
        cluster = [
            sys.executable,
            "-m",
            "ops.local_cluster",
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--var-dir",
            str(tmp_path / "var"),
            "--rpc-port",
            "0",
        ]
        # Started the way a shell starts a background job: SIGINT ignored, which Python keeps
        # ignored unless the program installs its own handler (the cluster must).
        proc = subprocess.Popen(
            ["bash", "-c", 'trap "" INT; exec "$@"', "bash", *cluster],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # the signal goes to the cluster process only
        )
    seen: list[psutil.Process] = []
    try:
        yield proc, log, seen
    finally:
        # Whatever the outcome, leave nothing running for the next test.
        if proc.poll() is None:
            seen.extend(_descendants(proc.pid))
            proc.kill()
            proc.wait(10)
        for leftover in seen:
            with contextlib.suppress(psutil.Error):
                leftover.kill()


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _names(processes: list[psutil.Process]) -> list[str]:
    names = []
    for process in processes:
        try:
            names.append(" ".join(process.cmdline()[:4]))
        except psutil.Error:
            names.append(f"pid {process.pid} (gone)")
    return names


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
    ids=lambda sig: sig.name,
)
def test_signal_leaves_no_process_behind(
    cluster_process: tuple[subprocess.Popen[bytes], Path, list[psutil.Process]],
    sig: signal.Signals,
) -> None:
    proc, log, seen = cluster_process
    text = _wait_for_line(log, READY_LINE, proc, timeout=180)
    match = re.search(r"OpenAI-compatible API: (\S+)/v1", text)
    assert match, text
    url = match.group(1)

    response = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {AI_KEY}"},
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 4,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text

    family = _descendants(proc.pid)
    seen.extend(family)
    commands = " | ".join(_names(family))
    assert "interfaces.cli.main controller" in commands
    assert commands.count("agent.main") == 2
    assert "llama-server" in commands, commands
    assert commands.count("ggml-rpc-server") == 2, commands

    proc.send_signal(sig)
    code = proc.wait(60)
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:
        assert code == 0, log.read_text(errors="replace")[-3000:]
        assert "every process of the cluster has exited" in log.read_text(errors="replace")

    # SIGKILL leaves the clean-up to PR_SET_PDEATHSIG; give the chain a moment to run.
    _, alive = psutil.wait_procs(family, timeout=30 if sig == signal.SIGKILL else 1)
    assert not alive, f"left behind after {sig.name}: {_names(alive)}"
