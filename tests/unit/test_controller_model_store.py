"""The controller's own model store (infrastructure/model_store.py) on tmp_path: a file is
copied in and hashed in one pass to ``<sha256>.gguf``, with progress; the same file is kept
once; a file that does not fit the disk or a copy that fails leaves no ``.incoming-*`` file."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from infrastructure import model_store
from infrastructure.model_store import DISK_RESERVE_BYTES, ControllerModelStore, StoreError

SMALL_CHUNK = 1000


def payload(size: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(size))


def source_file(tmp_path: Path, size: int = 4500, seed: int = 0, name: str = "m.gguf") -> Path:
    path = tmp_path / "src" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(payload(size, seed))
    return path


def store_of(tmp_path: Path) -> ControllerModelStore:
    return ControllerModelStore(tmp_path / "store")


def files_in(store: ControllerModelStore) -> list[str]:
    return sorted(p.name for p in store.directory.iterdir()) if store.directory.exists() else []


def disk_with_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    def usage(path: object) -> shutil._ntuple_diskusage:
        return shutil._ntuple_diskusage(free * 2, free, free)

    monkeypatch.setattr("infrastructure.model_store.shutil.disk_usage", usage)


def test_add_copies_and_hashes_to_its_sha256_with_increasing_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_store, "CHUNK", SMALL_CHUNK)
    source = source_file(tmp_path, 4500)
    expected = hashlib.sha256(source.read_bytes()).hexdigest()
    seen: list[tuple[int, int]] = []
    stored = store_of(tmp_path).add(source, lambda done, total: seen.append((done, total)))
    assert stored.sha256 == expected and stored.size_bytes == 4500
    assert stored.path == tmp_path / "store" / f"{expected}.gguf"
    assert stored.path.read_bytes() == source.read_bytes()
    assert source.is_file()  # a copy: the operator's file stays
    assert [done for done, _ in seen] == [1000, 2000, 3000, 4000, 4500]
    assert {total for _, total in seen} == {4500}
    assert files_in(store_of(tmp_path)) == [f"{expected}.gguf"]


def test_the_same_file_added_twice_is_kept_once(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    first = store.add(source_file(tmp_path, name="a.gguf"))
    second = store.add(source_file(tmp_path, name="b.gguf"))  # same bytes, another name
    assert first == second
    assert files_in(store) == [f"{first.sha256}.gguf"]
    other = store.add(source_file(tmp_path, seed=7, name="c.gguf"))
    assert other.sha256 != first.sha256
    assert files_in(store) == sorted([f"{first.sha256}.gguf", f"{other.sha256}.gguf"])


def test_a_file_that_does_not_fit_is_refused_before_a_byte_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = source_file(tmp_path, 4500)
    store = store_of(tmp_path)
    disk_with_free(monkeypatch, DISK_RESERVE_BYTES + 4499)
    opened: list[object] = []
    monkeypatch.setattr(
        "infrastructure.model_store.tempfile.mkstemp", lambda **kw: opened.append(kw)
    )
    with pytest.raises(StoreError, match=r"m\.gguf is 4500 bytes.*free"):
        store.add(source)
    assert opened == []  # refused before any temporary file was made
    assert files_in(store) == []
    monkeypatch.undo()
    disk_with_free(monkeypatch, DISK_RESERVE_BYTES + 4500)  # just fits, with the reserve
    assert store.add(source).size_bytes == 4500


def test_a_too_small_disk_leaves_no_incoming_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_of(tmp_path)
    disk_with_free(monkeypatch, DISK_RESERVE_BYTES)  # nothing beyond the reserve
    with pytest.raises(StoreError, match="model store's disk"):
        store.add(source_file(tmp_path, 1))
    assert not any(name.startswith(".incoming-") for name in files_in(store))
    assert files_in(store) == []


def test_a_failing_copy_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = source_file(tmp_path)
    store = store_of(tmp_path)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("infrastructure.model_store.os.fsync", full_disk)
    with pytest.raises(StoreError, match="No space left on device"):
        store.add(source)
    assert files_in(store) == []


def test_a_copy_interrupted_by_anything_else_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_store, "CHUNK", SMALL_CHUNK)
    store = store_of(tmp_path)

    def interrupted(done: int, total: int) -> None:
        if done >= 2000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.add(source_file(tmp_path, 4500), interrupted)
    assert files_in(store) == []


def test_a_missing_source_or_a_directory_is_refused(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    with pytest.raises(StoreError, match="cannot read"):
        store.add(tmp_path / "missing.gguf")
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(StoreError, match="is not a file"):
        store.add(tmp_path / "dir.gguf")
    assert files_in(store) == []


def test_resolve_answers_only_a_stored_sha256(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    stored = store.add(source_file(tmp_path))
    assert store.resolve(stored.sha256) == stored.path
    missing = "0" * 64
    assert store.resolve(missing) is None
    (store.directory / f"{'1' * 64}.gguf").mkdir()  # not a file
    assert store.resolve("1" * 64) is None
    (tmp_path / "secret.gguf").write_bytes(b"x")
    for not_a_sha in (
        "",
        stored.sha256.upper(),
        stored.sha256[:63],
        stored.sha256 + "0",
        "../secret",
        f"{'a' * 64}/../../secret",
        stored.sha256 + ".gguf",
    ):
        assert store.resolve(not_a_sha) is None, not_a_sha


def test_remove_says_whether_the_store_held_the_file(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    stored = store.add(source_file(tmp_path))
    assert store.remove(stored.sha256) is True
    assert not stored.path.exists() and store.resolve(stored.sha256) is None
    assert store.remove(stored.sha256) is False
    assert store.remove("../src/m") is False
    assert (tmp_path / "src" / "m.gguf").is_file()


def test_an_empty_file_is_stored_under_the_empty_sha256(tmp_path: Path) -> None:
    source = tmp_path / "empty.gguf"
    source.write_bytes(b"")
    stored = store_of(tmp_path).add(source)
    assert stored.sha256 == hashlib.sha256(b"").hexdigest() and stored.size_bytes == 0
    assert stored.path.stat().st_size == 0
    assert os.listdir(tmp_path / "store") == [stored.path.name]
