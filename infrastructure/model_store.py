"""The controller's own model store: GGUF files kept in ``MODEL_STORE_DIR`` as
``<sha256>.gguf``, for nodes to fetch (served by ``interfaces.model_store_server``).

``dacp models add PATH`` copies a file in and hashes it in the same pass, reporting progress;
the copy goes to a hidden temporary file first and gets its final name only once whole, so
the store never holds a partial file under a model's name. A file that does not fit the disk
is refused before a byte is copied.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
#: Space a copy leaves free on the store's disk.
DISK_RESERVE_BYTES = 64 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")

#: Called with (bytes copied, total) as the copy goes.
Progress = Callable[[int, int], None]


class StoreError(RuntimeError):
    """A file the store cannot take; the message says why."""


@dataclass(frozen=True)
class StoredFile:
    sha256: str
    size_bytes: int
    path: Path


class ControllerModelStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path_of(self, sha256: str) -> Path:
        return self.directory / f"{sha256}.gguf"

    def resolve(self, sha256: str) -> Path | None:
        """The stored file of a model, if the store holds it."""
        if _SHA256.fullmatch(sha256) is None:
            return None
        path = self.path_of(sha256)
        return path if path.is_file() else None

    def add(self, source: Path, progress: Progress | None = None) -> StoredFile:
        """Copies ``source`` into the store, hashing it on the way; returns what was stored
        (a file the store holds already is not copied twice)."""
        try:
            size = source.stat().st_size
        except OSError as e:
            raise StoreError(f"cannot read {source}: {e.strerror or e}") from e
        if not source.is_file():
            raise StoreError(f"{source} is not a file")
        self.directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.directory).free
        if size > free - DISK_RESERVE_BYTES:
            raise StoreError(
                f"{source.name} is {size} bytes; the model store's disk ({self.directory}) has "
                f"{free} free (keeping {DISK_RESERVE_BYTES} in reserve)"
            )
        hasher = hashlib.sha256()
        fd, tmp_name = tempfile.mkstemp(prefix=".incoming-", dir=self.directory)
        tmp = Path(tmp_name)
        try:
            with source.open("rb", buffering=0) as src, os.fdopen(fd, "wb", buffering=0) as out:
                buffer = bytearray(CHUNK)
                view = memoryview(buffer)
                done = 0
                while n := src.readinto(buffer):
                    out.write(view[:n])
                    hasher.update(view[:n])
                    done += n
                    if progress is not None:
                        progress(done, size)
                os.fsync(out.fileno())
            sha256 = hasher.hexdigest()
            final = self.path_of(sha256)
            if final.is_file():
                tmp.unlink()
            else:
                os.replace(tmp, final)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"copying {source} into the model store failed: {e}") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return StoredFile(sha256, done, final)

    def remove(self, sha256: str) -> bool:
        """Deletes a stored file; False when the store did not hold it."""
        path = self.resolve(sha256)
        if path is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return True
