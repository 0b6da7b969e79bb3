"""First-run set-up, with the independent steps running side by side.

    python3 -m ops.bootstrap demo      # venv (+demo extra), llama.cpp, model
    python3 -m ops.bootstrap test      # venv (+dev extra), llama.cpp, model, Chromium,
                                       # the Node SDK conformance packages (npm ci)

The llama.cpp compile dominates a first run (minutes on 2 cores), so it starts at once and
everything else (the virtualenv install, the model download, the browser package, the Node
packages) happens while it compiles. Each step runs as its own process; its lines are printed
as they come, prefixed with the step's name, and a summary with every step's wall time closes
the run.
A second run finds everything cached and takes a second or two.

Standard library only: this runs with the system ``python3`` before the venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ops.process_lines import output_lines

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
STAMP_NAME = ".dacp-installed.json"
MIN_PYTHON = (3, 11)
#: Which extra of pyproject.toml each target installs into the venv.
EXTRAS = {"demo": "demo", "test": "dev"}
CHROMIUM = Path("/usr/bin/chromium")
#: The Node ``openai`` SDK conformance harness (tests/conformance/node_sdk.py) and its packages.
NODE_SDK_DIR = REPO / "tests" / "conformance" / "node"
STEP_NAMES = ("venv", "llama.cpp", "model", "browser", "node-sdk")


@dataclass
class Step:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    code: int | None = None
    tail: list[str] = field(default_factory=list)


_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def _elapsed(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60}m{whole % 60:02d}s" if whole >= 60 else f"{seconds:.1f}s"


def _run(step: Step, width: int) -> None:
    started = time.monotonic()
    label = f"[{step.name}]".ljust(width + 2)
    try:
        proc = output_lines(
            step.argv, env={**os.environ, **step.env, "PYTHONUNBUFFERED": "1"}, cwd=REPO
        )
    except OSError as exc:
        step.code, step.tail = 127, [f"cannot start {step.argv[0]}: {exc}"]
        say(f"{label} {step.tail[0]}")
        return
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.rstrip()
        if line:
            step.tail = [*step.tail[-19:], line]
            say(f"{label} {line}")
    step.code = proc.wait()
    step.seconds = time.monotonic() - started
    verdict = "done" if step.code == 0 else f"FAILED (exit {step.code})"
    say(f"{label} {verdict} in {_elapsed(step.seconds)}")


def run_parallel(steps: Sequence[Step]) -> bool:
    width = max(len(step.name) for step in steps)
    threads = [threading.Thread(target=_run, args=(step, width), daemon=True) for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return all(step.code == 0 for step in steps)


# --- the steps ----------------------------------------------------------------------------


def _pyproject_digest() -> str:
    return hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]


def venv_is_current(extra: str) -> bool:
    """True when .venv was installed from this pyproject.toml with ``extra`` (or ``dev``)."""
    try:
        stamp = json.loads((VENV / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict) or stamp.get("pyproject") != _pyproject_digest():
        return False
    extras = set(stamp.get("extras") or ())
    return extra in extras or "dev" in extras


def venv_step(extra: str) -> Step:
    """Create .venv if needed and install the project with ``extra`` (``ops.venv_install``)."""
    return Step("venv", [sys.executable, "-m", "ops.venv_install", extra])


def llama_step() -> Step:
    return Step("llama.cpp", [sys.executable, "-m", "ops.build_llama"])


def model_step() -> Step:
    return Step("model", [sys.executable, "-m", "ops.fetch_model"])


def browser_step() -> Step | None:
    """Debian's Chromium for the dashboard test; None when it is already installed."""
    if CHROMIUM.exists():
        return None
    script = (
        "set -e; echo 'installing Debian chromium with apt-get (for the dashboard test) ...';"
        " apt-get update -qq;"
        " DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends"
        " chromium > /dev/null; chromium --version"
    )
    if shutil.which("apt-get") is None:
        script = "echo 'chromium is missing and apt-get is not available: install chromium'; exit 1"
    return Step("browser", ["bash", "-c", script])


def node_modules_current(directory: Path | None = None) -> bool:
    """True when ``npm`` has installed ``directory``'s package-lock.json since it last changed.

    npm writes ``node_modules/.package-lock.json`` on every install: ``npm ci`` leaves it
    newer than ``package-lock.json``, ``npm install`` gives both the same mtime. Either way
    the lock has not moved since; a pulled or edited lock is newer and installs again.
    """
    directory = directory or NODE_SDK_DIR
    try:
        installed = (directory / "node_modules" / ".package-lock.json").stat().st_mtime
        wanted = (directory / "package-lock.json").stat().st_mtime
    except OSError:
        return False
    return installed >= wanted


def node_sdk_step() -> Step | None:
    """``npm ci`` for the Node SDK conformance tests; None when node_modules is current."""
    if node_modules_current():
        return None
    if shutil.which("npm") is None:
        message = "npm not found: Node.js 20+ and npm are needed for the Node SDK conformance tests"
        return Step("node-sdk", [sys.executable, "-c", f"print({message!r}); raise SystemExit(1)"])
    return Step("node-sdk", ["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(NODE_SDK_DIR)])


def plan(target: str, *, only: Sequence[str] = ()) -> list[Step]:
    steps: list[Step] = []
    wanted = set(only) or set(STEP_NAMES)
    if "llama.cpp" in wanted:
        steps.append(llama_step())  # first: the long pole starts before anything else
    if "venv" in wanted and not venv_is_current(EXTRAS[target]):
        steps.append(venv_step(EXTRAS[target]))
    if "model" in wanted:
        steps.append(model_step())
    if target == "test" and "browser" in wanted and (browser := browser_step()) is not None:
        steps.append(browser)
    if target == "test" and "node-sdk" in wanted and (node_sdk := node_sdk_step()) is not None:
        steps.append(node_sdk)
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ops.bootstrap", description=__doc__)
    parser.add_argument("target", choices=sorted(EXTRAS), help="what the set-up is for")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=list(STEP_NAMES),
        help="run only this step (repeatable)",
    )
    args = parser.parse_args(argv)
    if sys.version_info < MIN_PYTHON:
        wanted = ".".join(map(str, MIN_PYTHON))
        print(f"bootstrap: Python {wanted}+ is required, this is {sys.version.split()[0]}")
        return 2
    started = time.monotonic()
    steps = plan(args.target, only=args.only)
    if not steps:
        say(f"== set-up for `make {args.target}`: everything is in place")
        return 0
    names = ", ".join(step.name for step in steps)
    say(f"== set-up for `make {args.target}`: {names} (in parallel)")
    ok = run_parallel(steps)
    total = time.monotonic() - started
    timings = ", ".join(f"{step.name} {_elapsed(step.seconds)}" for step in steps)
    if not ok:
        for step in steps:
            if step.code != 0:
                last = step.tail[-1] if step.tail else "no output"
                say(f"== set-up failed: {step.name} exited {step.code}: {last}")
        return 1
    say(f"== set-up finished in {_elapsed(total)} ({timings})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
