"""The model file an execution plan names: found in the models dir and its sha256 verified.

The first plan for a (file, sha256) reads the agent's hash cache (or hashes the file) on a
worker thread; later plans for the same pair need one ``stat`` on the event loop while the
file's size and mtime are unchanged, which keeps a warm request's setup off threads.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.models.model_store import ModelStore
from agent.runtime.job_messages import MODEL_NOT_FOUND, SHA256_MISMATCH, SetupFailure


class PlanModels:
    """Resolves a plan's model file, remembering what it verified."""

    def __init__(self, models_dir: Path, data_dir: Path) -> None:
        self.models_dir = models_dir
        self.data_dir = data_dir
        # (file name, sha256) -> (path, size, mtime_ns) of model files verified here.
        self._verified: dict[tuple[str, str], tuple[Path, int, int]] = {}

    async def resolve(self, file_name: str, expected_sha256: str) -> Path:
        """The verified path of ``file_name``, or :class:`SetupFailure` (``MODEL_NOT_FOUND``,
        ``SHA256_MISMATCH``)."""
        known = self.verified_before(file_name, expected_sha256)
        if known is not None:
            return known
        return await asyncio.to_thread(self.find_and_verify, file_name, expected_sha256)

    def verified_before(self, file_name: str, expected_sha256: str) -> Path | None:
        """The file verified for (name, sha256) already, if its size and mtime still match."""
        known = self._verified.get((file_name, expected_sha256))
        if known is None:
            return None
        path, size, mtime_ns = known
        try:
            stat = path.stat()
        except OSError:
            return None
        return path if (stat.st_size, stat.st_mtime_ns) == (size, mtime_ns) else None

    def find_and_verify(self, file_name: str, expected_sha256: str) -> Path:
        # A fresh store re-reads the hash cache the agent session keeps up to date.
        store = ModelStore(self.models_dir, self.data_dir)
        path = store.find(file_name)
        if path is None:
            raise SetupFailure(
                MODEL_NOT_FOUND, f"model file {file_name!r} not found in {store.models_dir}"
            )
        if not store.verify(path, expected_sha256):
            model = store.describe(path)
            found = f"cannot be verified: {model.error}" if model.error else f"is {model.sha256}"
            raise SetupFailure(
                SHA256_MISMATCH,
                f"sha256 of {path} {found}; the plan expects {expected_sha256 or '(none)'}",
            )
        stat = path.stat()
        self._verified[(file_name, expected_sha256)] = (path, stat.st_size, stat.st_mtime_ns)
        return path
