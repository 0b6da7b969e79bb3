"""The controller's own model store: GGUF files kept in ``MODEL_STORE_DIR`` as
``<sha256>.gguf``, for nodes to fetch (served by ``interfaces.model_store_server``). Several
model names may register one file: ``<sha256>.names`` lists them, and the file goes only when
the last name lets it go.

``dacp models add PATH`` copies a file in and hashes it in the same pass, reporting progress;
the copy goes to a hidden temporary file first and gets its final name only once whole, so
the store never holds a partial file under a model's name. A file that does not fit the disk
is refused before a byte is copied.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from domain.model_claims import ByteRange

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

    def names_path(self, sha256: str) -> Path:
        return self.directory / f"{sha256}.names"

    def names(self, sha256: str) -> set[str]:
        """The model names the stored file is registered under."""
        try:
            return set(json.loads(self.names_path(sha256).read_text(encoding="utf-8")))
        except (FileNotFoundError, ValueError, TypeError):
            return set()

    def _write_names(self, sha256: str, names: set[str]) -> None:
        path = self.names_path(sha256)
        if not names:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(sorted(names)), encoding="utf-8")
        os.replace(tmp, path)

    def keep(self, sha256: str, name: str) -> None:
        """Records that model ``name`` is registered with the stored file."""
        self._write_names(sha256, self.names(sha256) | {name})

    def release(self, sha256: str, name: str) -> bool:
        """Model ``name`` no longer uses the stored file; the file is deleted when no other
        name does. True when it was deleted."""
        names = self.names(sha256) - {name}
        self._write_names(sha256, names)
        if names:
            return False
        return self.remove(sha256)

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
        try:
            src = source.open("rb", buffering=0)
        except OSError as e:
            raise StoreError(f"cannot read {source}: {e.strerror or e}") from e
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=".incoming-", dir=self.directory)
        except OSError as e:
            src.close()
            raise StoreError(f"cannot write into the model store {self.directory}: {e}") from e
        tmp = Path(tmp_name)
        try:
            with src, os.fdopen(fd, "wb", buffering=0) as out:
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

    def read_ranges(self, sha256: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        """The bytes of ``ranges`` of the stored file (a node's proof is checked against
        them); None when the store does not hold it or it is shorter than a range needs."""
        path = self.resolve(sha256)
        if path is None:
            return None
        out = []
        try:
            with path.open("rb") as handle:
                for r in ranges:
                    handle.seek(r.offset)
                    data = handle.read(r.length)
                    if len(data) != r.length:
                        return None
                    out.append(data)
        except OSError:
            return None
        return out

    def remove(self, sha256: str) -> bool:
        """Deletes a stored file; False when the store did not hold it."""
        path = self.resolve(sha256)
        if path is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return True
