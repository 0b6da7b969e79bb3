"""ops.gpu_payload: which requirements travel, which wheels stay behind, and the size check
against what a device command may carry."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ops import gpu_payload
from ops.gpu_payload import CARRY_LIMIT_BYTES, MIB, SizeCheck

ROOT = Path(__file__).resolve().parents[2]


def test_the_projects_requirements_are_its_runtime_ones_only() -> None:
    requirements = gpu_payload.runtime_requirements(ROOT / "pyproject.toml")
    names = {
        gpu_payload.normalize(r.split("[")[0].split(">")[0].split(";")[0]) for r in requirements
    }
    assert {"litestar", "grpcio", "gguf", "cryptography", "psycopg", "redis"} <= names
    assert not names & {"pytest", "mypy", "ruff", "openai", "playwright"}
    # the SQLite default imports the Postgres recorder (and psycopg's pool with it)
    assert "eventsourcing[postgres]>=9.5,<9.6" in requirements


def test_a_broken_pyproject_is_named(tmp_path: Path) -> None:
    with pytest.raises(gpu_payload.PayloadError, match=r"cannot read \[project\]\.dependencies"):
        gpu_payload.runtime_requirements(tmp_path / "missing.toml")


def test_wheels_of_what_the_gpu_machine_has_are_removed(tmp_path: Path) -> None:
    names = [
        "numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.whl",
        "psycopg_binary-3.3.9-cp312-cp312-manylinux2014_x86_64.whl",
        "numpydoc-1.0-py3-none-any.whl",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert gpu_payload.drop_present(tmp_path) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert gpu_payload.wheel_distribution(names[2]) == "psycopg-binary"
    assert gpu_payload.wheel_distribution("notes.txt") is None


def test_pip_downloads_binary_wheels_for_the_gpu_machines_python(tmp_path: Path) -> None:
    command = gpu_payload.pip_download_command(["gguf>=0.10"], tmp_path)
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert "manylinux2014_x86_64" in command
    assert "manylinux_2_29_x86_64" not in command  # newer than the rehearsing machine's glibc
    assert command[-3:] == ["--dest", str(tmp_path), "gguf>=0.10"]


def test_the_size_check_counts_the_working_tree_too() -> None:
    fits = SizeCheck(payload_bytes=58 * MIB, tree_bytes=3 * MIB)
    assert fits.fits
    assert fits.line() == (
        "payload 58.0 MiB + working tree 3.0 MiB = 61.0 MiB of the 64 MiB a device command "
        "carries (3.0 MiB left)"
    )
    assert not SizeCheck(payload_bytes=62 * MIB, tree_bytes=3 * MIB).fits
    assert SizeCheck(payload_bytes=CARRY_LIMIT_BYTES, tree_bytes=None).fits


def test_an_oversized_payload_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(
        gpu_payload, "build", lambda out, repo: SizeCheck(CARRY_LIMIT_BYTES, 1 * MIB)
    )
    assert gpu_payload.main(["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("gpu_payload: too large to carry: payload 64.0 MiB")


def test_the_working_tree_is_what_git_would_send(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("gpu-payload/\n")  # 13 bytes
    (tmp_path / "tracked.py").write_bytes(b"x" * 100)
    git("add", ".gitignore", "tracked.py")
    (tmp_path / "untracked.txt").write_bytes(b"y" * 10)
    (tmp_path / "gpu-payload").mkdir()
    (tmp_path / "gpu-payload" / "big.whl").write_bytes(b"z" * 5000)
    assert gpu_payload.working_tree_bytes(tmp_path) == 13 + 100 + 10
    assert gpu_payload.working_tree_bytes(tmp_path / "not-a-repo") is None


def test_tokenizers_travel_without_the_hub_client_it_only_needs_for_downloads(
    tmp_path: Path,
) -> None:
    requirements = gpu_payload.runtime_requirements(ROOT / "pyproject.toml")
    alone = [
        r
        for r in requirements
        if gpu_payload.requirement_name(r) in gpu_payload.WITHOUT_DEPENDENCIES
    ]
    assert alone == ["tokenizers>=0.20"]
    assert gpu_payload.requirement_name("eventsourcing[postgres]>=9.5,<9.6") == "eventsourcing"
    command = gpu_payload.pip_download_command(alone, tmp_path, dependencies=False)
    assert "--no-deps" in command and command[-1] == "tokenizers>=0.20"
    assert "--no-deps" not in gpu_payload.pip_download_command(alone, tmp_path)
