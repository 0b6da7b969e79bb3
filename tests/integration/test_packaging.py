"""Installing the project is quiet: setuptools has nothing to warn about, and the wheel carries
the dashboard's static files and the proto sources."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.integration.source_tree import copy_source_tree


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked files, copied: a build writes build/ and *.egg-info next to the sources."""
    return copy_source_tree(tmp_path_factory.mktemp("src"))


@pytest.mark.parametrize("hook", ["build_wheel", "build_editable"])
def test_build_hooks_print_no_warning(source_copy: Path, tmp_path: Path, hook: str) -> None:
    script = f"import setuptools.build_meta as b; print(b.{hook}({str(tmp_path)!r}))"
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", script],
        cwd=source_copy,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if re.search(r"Warning\b|WARNING", line)]
    assert warnings == []
    if hook == "build_wheel":
        wheel = next(tmp_path.glob("*.whl"))
        names = set(zipfile.ZipFile(wheel).namelist())
        for expected in (
            "interfaces/http/admin/static/dashboard.html",
            "interfaces/http/admin/static/dashboard.js",
            "interfaces/http/admin/static/dashboard.css",
            "wire/control.proto",
            "domain/py.typed",
        ):
            assert expected in names
