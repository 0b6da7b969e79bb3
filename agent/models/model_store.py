"""Local GGUF model files: discovery, sha256 identity and metadata.

``ModelStore.scan()`` lists ``*.gguf`` files in the models dir. For each file it needs the
sha256 (the model's identity in execution plans) and a few GGUF metadata values (read with
``gguf.GGUFReader``). Both are expensive — hashing reads the whole file, and parsing the
tokenizer arrays of even a 100 MB model takes seconds — so both are cached in
``<data_dir>/model_cache.json`` keyed by (absolute path, size, mtime_ns) and recomputed only
when one of those changes. A file that is not a readable GGUF becomes an error entry.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from common.gguf_metadata import GgufMetadata, read_gguf_metadata
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

CACHE_FILE_NAME = "model_cache.json"
CACHE_SCHEMA_VERSION = 1
HASH_CHUNK_BYTES = 1024 * 1024

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

ProgressCallback = Callable[[Path, int, int], None]
"""Called as ``progress(path, bytes_done, bytes_total)`` about every 10% while hashing."""


def log_progress(path: Path, done: int, total: int) -> None:
    """Default progress callback: one log line per ~10%."""
    percent = 100 if total == 0 else done * 100 // total
    log.info("hashing %s: %d%% (%d / %d MiB)", path.name, percent, done >> 20, total >> 20)


# ---------------------------------------------------------------------------
# sha256
# ---------------------------------------------------------------------------


def sha256_file(path: Path | str, progress: ProgressCallback | None = None) -> str:
    """Lowercase hex sha256 of a file, reporting progress about every 10%."""
    file_path = Path(path)
    digest = hashlib.sha256()
    total = file_path.stat().st_size
    step = max(total // 10, 1)
    next_report = step
    done = 0
    with file_path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None and done >= next_report:
                progress(file_path, done, total)
                next_report = (done // step + 1) * step
    if progress is not None and total == 0:
        progress(file_path, 0, 0)
    return digest.hexdigest()


def _normalise_sha256(value: str) -> str | None:
    candidate = value.strip().lower()
    return candidate if _SHA256_HEX.match(candidate) else None


# ---------------------------------------------------------------------------
# Model entries
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    file_name: str
    path: str
    size_bytes: int
    sha256: str = ""
    parameters: int = 0
    layers: int = 0
    context_length: int = 0
    kv_bytes_per_token: int = 0
    architecture: str = ""
    error: str = ""  # non-empty: the file could not be used; other fields are unreliable

    @property
    def ok(self) -> bool:
        return not self.error

    def to_proto(self) -> pb.LocalModel:
        """The ``LocalModel`` message: it has exactly this entry's fields, by the same names."""
        return pb.LocalModel(**asdict(self))


@dataclass(frozen=True)
class _CacheEntry:
    """What the hash cache keeps of one file: its size and mtime when hashed, its sha256 and
    the GGUF metadata a :class:`LocalModel` reports."""

    size: int
    mtime_ns: int
    sha256: str
    architecture: str
    parameters: int
    layers: int
    context_length: int
    kv_bytes_per_token: int

    @classmethod
    def describing(cls, stat: os.stat_result, sha256: str, metadata: GgufMetadata) -> _CacheEntry:
        """The entry of a file as ``stat`` saw it, with its sha256 and GGUF metadata."""
        return cls(
            size=stat.st_size,
            mtime_ns=stat.st_mtime_ns,
            sha256=sha256,
            architecture=metadata.architecture,
            parameters=metadata.parameters,
            layers=metadata.layers,
            context_length=metadata.context_length,
            kv_bytes_per_token=metadata.kv_bytes_per_token,
        )


class HashCache:
    """JSON cache of sha256 + metadata keyed by (absolute path, size, mtime_ns)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, _CacheEntry] = {}
        self._dirty = False
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable model cache %s: %s", self.path, exc)
            return
        if not isinstance(raw, dict) or raw.get("version") != CACHE_SCHEMA_VERSION:
            return
        entries = raw.get("entries")
        if not isinstance(entries, dict):
            return
        for key, value in entries.items():
            try:
                entry = _CacheEntry(**value)
            except TypeError:
                continue
            if _normalise_sha256(entry.sha256) is None:
                continue
            self._entries[key] = entry

    def get(self, path: Path, size: int, mtime_ns: int) -> _CacheEntry | None:
        entry = self._entries.get(str(path))
        if entry is None or entry.size != size or entry.mtime_ns != mtime_ns:
            return None
        return entry

    def put(self, path: Path, entry: _CacheEntry) -> None:
        if self._entries.get(str(path)) != entry:
            self._entries[str(path)] = entry
            self._dirty = True

    def retain(self, paths: Iterable[Path]) -> None:
        keep = {str(p) for p in paths}
        for key in [k for k in self._entries if k not in keep]:
            del self._entries[key]
            self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        payload = {
            "version": CACHE_SCHEMA_VERSION,
            "entries": {key: asdict(entry) for key, entry in sorted(self._entries.items())},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".model_cache-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(payload, handle, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._dirty = False


class ModelStore:
    """The GGUF files in one models dir, with cached sha256 and metadata."""

    def __init__(
        self,
        models_dir: Path | str,
        data_dir: Path | str,
        *,
        progress: ProgressCallback | None = log_progress,
    ) -> None:
        self.models_dir = Path(models_dir).expanduser().absolute()
        self.data_dir = Path(data_dir).expanduser().absolute()
        self.progress = progress
        self.cache = HashCache(self.data_dir / CACHE_FILE_NAME)

    def model_paths(self) -> list[Path]:
        """``*.gguf`` files (case-insensitive) directly in the models dir, sorted by name."""
        try:
            children = list(self.models_dir.iterdir())
        except FileNotFoundError:
            return []
        return sorted(
            (p for p in children if p.suffix.lower() == ".gguf" and p.is_file()),
            key=lambda p: p.name,
        )

    def scan(self) -> list[LocalModel]:
        """Every GGUF file as a LocalModel; unreadable ones carry ``error``. Never raises
        for a bad model file. The cache is read again first: a fetch may have added to it."""
        self.cache = HashCache(self.cache.path)
        paths = self.model_paths()
        models = [self.describe(path) for path in paths]
        self.cache.retain(paths)
        try:
            self.cache.save()
        except OSError as exc:
            log.warning("cannot write model cache %s: %s", self.cache.path, exc)
        return models

    def describe(self, path: Path) -> LocalModel:
        """One file as a LocalModel, from the cache when (size, mtime_ns) are unchanged."""
        path = path.absolute()
        try:
            before = path.stat()
        except OSError as exc:
            return LocalModel(file_name=path.name, path=str(path), size_bytes=0, error=str(exc))
        base = LocalModel(file_name=path.name, path=str(path), size_bytes=before.st_size)

        cached = self.cache.get(path, before.st_size, before.st_mtime_ns)
        if cached is not None:
            return _model_from_entry(base, cached)

        try:
            metadata = read_gguf_metadata(path)
        except Exception as exc:
            log.warning("%s is not a usable GGUF file: %s", path, exc)
            return _with_error(base, f"not a readable GGUF file: {exc}")
        try:
            digest = sha256_file(path, self.progress)
            after = path.stat()
        except OSError as exc:
            return _with_error(base, f"cannot hash file: {exc}")
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            return _with_error(base, "file changed while it was being hashed (still copying?)")

        entry = _CacheEntry.describing(before, digest, metadata)
        self.cache.put(path, entry)
        return _model_from_entry(base, entry)

    def cached_path(self, sha256: str) -> Path | None:
        """The file in the models dir whose cached sha256 is ``sha256`` and which has not
        changed since it was hashed (nothing is hashed here)."""
        cache = HashCache(self.cache.path)
        for path in self.model_paths():
            stat = path.stat()
            entry = cache.get(path.absolute(), stat.st_size, stat.st_mtime_ns)
            if entry is not None and entry.sha256 == sha256:
                return path
        return None

    def remember(self, path: Path, sha256: str) -> None:
        """Records a file whose sha256 was just checked (a fetched model) in the cache, so
        that nobody hashes it again."""
        path = path.absolute()
        metadata = read_gguf_metadata(path)
        stat = path.stat()
        self.cache = HashCache(self.cache.path)
        self.cache.put(path, _CacheEntry.describing(stat, sha256, metadata))
        self.cache.save()

    def find(self, file_name: str) -> Path | None:
        """The path of ``file_name`` in the models dir, if it is there (no path traversal)."""
        if not file_name or Path(file_name).name != file_name:
            return None
        candidate = self.models_dir / file_name
        return candidate if candidate.is_file() else None

    def verify(self, path: Path | str, expected_sha256: str) -> bool:
        """Like :func:`verify_sha256` but trusts the cache while (size, mtime_ns) match."""
        expected = _normalise_sha256(expected_sha256)
        file_path = Path(path).absolute()
        if expected is None:
            return False
        try:
            stat = file_path.stat()
        except OSError:
            return False
        cached = self.cache.get(file_path, stat.st_size, stat.st_mtime_ns)
        if cached is not None:
            return cached.sha256 == expected
        model = self.describe(file_path)
        try:
            self.cache.save()
        except OSError as exc:
            log.warning("cannot write model cache %s: %s", self.cache.path, exc)
        return model.ok and model.sha256 == expected


def _model_from_entry(base: LocalModel, entry: _CacheEntry) -> LocalModel:
    return LocalModel(
        file_name=base.file_name,
        path=base.path,
        size_bytes=base.size_bytes,
        sha256=entry.sha256,
        parameters=entry.parameters,
        layers=entry.layers,
        context_length=entry.context_length,
        kv_bytes_per_token=entry.kv_bytes_per_token,
        architecture=entry.architecture,
    )


def _with_error(base: LocalModel, error: str) -> LocalModel:
    return LocalModel(
        file_name=base.file_name, path=base.path, size_bytes=base.size_bytes, error=error
    )


def verify_sha256(
    path: Path | str, expected: str, progress: ProgressCallback | None = None
) -> bool:
    """True when the file exists and its sha256 equals ``expected`` (hex, any case).

    Always reads the whole file; use :meth:`ModelStore.verify` to trust the cache.
    """
    wanted = _normalise_sha256(expected)
    if wanted is None:
        return False
    try:
        return sha256_file(path, progress) == wanted
    except OSError:
        return False
