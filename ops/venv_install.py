"""Create ``.venv`` and install the project into it with one extra, showing progress.

    python3 -m ops.venv_install demo|dev

pip's own output (one line per package) goes to ``.venv/pip-install.log``; the terminal gets a
line every few seconds saying how far the install is, pip's errors, and a count of its
warnings. A stamp (pyproject digest + extras) makes ``ops.bootstrap`` skip a current venv.

The project is installed editable; ``pyproject.toml`` declares every package (the dashboard's
static files as ``interfaces.static`` package data), so setuptools has nothing to warn about.
Standard library only: it runs with the system ``python3``.
"""

from __future__ import annotations

import json
import re
import sys
import time
import venv
from collections.abc import Sequence

from ops.bootstrap import REPO, STAMP_NAME, VENV, _pyproject_digest
from ops.process_lines import output_lines

LOG_NAME = "pip-install.log"
PROGRESS_SECONDS = 5.0
_COLLECTING = re.compile(r"^\s*(?:Collecting|Requirement already satisfied:)\s+([A-Za-z0-9_.\-]+)")
_INSTALLING = re.compile(r"^\s*Installing collected packages: (.*)$")
_INSTALLED = re.compile(r"^\s*Successfully installed (.*)$")


def venv_python() -> str:
    scripts = "Scripts" if sys.platform == "win32" else "bin"
    return str(VENV / scripts / ("python.exe" if sys.platform == "win32" else "python"))


def _installed_extras() -> set[str]:
    try:
        stamp = json.loads((VENV / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    if not isinstance(stamp, dict) or stamp.get("pyproject") != _pyproject_digest():
        return set()
    return set(stamp.get("extras") or ())


def install(extra: str) -> int:
    started = time.monotonic()
    if not (VENV / "pyvenv.cfg").exists():
        print(f"creating {VENV.relative_to(REPO)} with {sys.executable} ...", flush=True)
        venv.EnvBuilder(with_pip=True, clear=False).create(VENV)
    extras = _installed_extras()
    (VENV / STAMP_NAME).unlink(missing_ok=True)
    log_path = VENV / LOG_NAME
    print(f"installing the project with the [{extra}] extra (pip log: {log_path}) ...", flush=True)
    command = [
        venv_python(),
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-e",
        f".[{extra}]",
    ]
    collected = 0
    warnings = 0
    last_name = ""
    last_print = time.monotonic()
    with log_path.open("w", encoding="utf-8") as log:
        proc = output_lines(command, cwd=REPO)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if match := _COLLECTING.match(line):
                collected += 1
                last_name = match.group(1)
            elif match := _INSTALLING.match(line):
                count = len(match.group(1).split(","))
                print(f"  resolved {collected} requirements; installing {count} packages ...")
            elif match := _INSTALLED.match(line):
                print(f"  installed {len(match.group(1).split())} packages", flush=True)
            elif line.startswith("ERROR"):
                print(f"  {line.rstrip()}", flush=True)
            elif line.startswith("WARNING") or "Warning" in line:
                warnings += 1
            now = time.monotonic()
            if now - last_print >= PROGRESS_SECONDS and collected:
                print(f"  {collected} requirements collected (latest: {last_name}) ...", flush=True)
                last_print = now
        code = proc.wait()
    if code != 0:
        print(f"pip install failed (exit {code}); see {log_path}", flush=True)
        return code
    if warnings:
        print(f"  pip printed {warnings} warning line(s); see {log_path}")
    stamp = {"pyproject": _pyproject_digest(), "extras": sorted(extras | {extra})}
    (VENV / STAMP_NAME).write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    print(f"venv ready in {time.monotonic() - started:.1f}s: {VENV}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in ("demo", "dev"):
        print("usage: python3 -m ops.venv_install demo|dev", file=sys.stderr)
        return 2
    return install(args[0])


if __name__ == "__main__":
    sys.exit(main())
