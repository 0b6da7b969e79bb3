"""The checkout's files as a build sees them, and the project's wheel built from a copy of them
(a build writes build/ and *.egg-info next to the sources, so it never runs in the checkout)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tracked_files(repo: Path = REPO) -> list[Path]:
    """Tracked files and untracked ones git does not ignore (relative paths), as they are on
    disk now: what a build of this working tree reads."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    return [Path(name.decode()) for name in listed if name and (repo / name.decode()).is_file()]


def copy_source_tree(dest: Path, repo: Path = REPO) -> Path:
    """Copies :func:`tracked_files` into ``dest``; returns ``dest``."""
    for relative in tracked_files(repo):
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / relative, dest / relative)
    return dest


def build_wheel(source: Path, out: Path) -> Path:
    """The project's wheel, built from ``source`` with setuptools' PEP 517 hook (this venv's
    setuptools, no build isolation: nothing is downloaded)."""
    script = f"import setuptools.build_meta as b; print(b.build_wheel({str(out)!r}))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=source,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"building the wheel failed:\n{result.stderr[-3000:]}")
    return out / result.stdout.strip().splitlines()[-1]
