"""agent.models.model_store against the real SmolLM2-135M GGUF and small GGUF files written here."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from agent.models import model_store
from agent.models.model_store import (
    CACHE_FILE_NAME,
    LocalModel,
    ModelStore,
    sha256_file,
    verify_sha256,
)
from common.gguf_metadata import GgufMetadata, kv_bytes_per_token, read_gguf_metadata
from ops.artifacts import ensure_model
from wire import control_pb2 as pb

SMOLLM2_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98_362_432


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real model, fetched and verified by ops (cached under ~/.cache/dacp)."""
    return ensure_model()


def link_or_copy(source: Path, target: Path) -> None:
    """Put ``source`` at ``target`` without touching the original's mtime."""
    try:
        target.symlink_to(source)
    except OSError:  # e.g. Windows without symlink privilege
        shutil.copyfile(source, target)


@pytest.fixture
def hash_calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Counts every sha256 computation the model store performs."""
    calls: list[Path] = []
    real = model_store.sha256_file

    def counting(path: Path | str, progress: model_store.ProgressCallback | None = None) -> str:
        calls.append(Path(path))
        return real(path, progress)

    monkeypatch.setattr(model_store, "sha256_file", counting)
    return calls


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    layers: int = 4,
    context: int = 2048,
    embedding: int = 64,
    heads: int = 8,
    kv_heads: int | None = 2,
) -> None:
    """A small but valid GGUF file (two tensors) written with gguf.GGUFWriter."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(embedding)
    writer.add_head_count(heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    writer.add_tensor("token_embd.weight", np.zeros((10, embedding), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((embedding, embedding), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_scan(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelStore, list[LocalModel], list[tuple[int, int]]]:
    root = tmp_path_factory.mktemp("real-store")
    models_dir = root / "models"
    models_dir.mkdir()
    link_or_copy(smollm2_path, models_dir / SMOLLM2_FILE_NAME)
    progress: list[tuple[int, int]] = []
    store = ModelStore(models_dir, root / "data", progress=lambda _p, d, t: progress.append((d, t)))
    return store, store.scan(), progress


def test_real_model_metadata(
    real_scan: tuple[ModelStore, list[LocalModel], list[tuple[int, int]]],
) -> None:
    _, models, _ = real_scan
    assert len(models) == 1
    model = models[0]
    assert model.ok, model.error
    assert model.file_name == SMOLLM2_FILE_NAME
    assert model.size_bytes == SMOLLM2_SIZE
    assert model.sha256 == SMOLLM2_SHA256
    assert model.architecture == "llama"
    assert model.layers == 30
    assert model.context_length == 8192
    assert model.parameters == 134_515_008  # "135M"
    # 30 layers, 3 KV heads, head_dim 576 / 9 = 64, f16 K+V: 2 * 30 * 3 * 64 * 2
    assert model.kv_bytes_per_token == 23_040


def test_real_model_hash_progress_every_ten_percent(
    real_scan: tuple[ModelStore, list[LocalModel], list[tuple[int, int]]],
) -> None:
    _, _, progress = real_scan
    assert 9 <= len(progress) <= 11
    assert progress[-1] == (SMOLLM2_SIZE, SMOLLM2_SIZE)
    assert all(total == SMOLLM2_SIZE for _, total in progress)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)


def test_real_model_second_scan_uses_cache(
    real_scan: tuple[ModelStore, list[LocalModel], list[tuple[int, int]]],
    hash_calls: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, first, _ = real_scan

    def no_parse(path: Path | str) -> GgufMetadata:
        raise AssertionError("cache hit must not re-read GGUF metadata")

    monkeypatch.setattr(model_store, "read_gguf_metadata", no_parse)
    # A fresh store (as after an agent restart) reads the JSON cache from the data dir.
    restarted = ModelStore(store.models_dir, store.data_dir)
    assert restarted.scan() == first
    assert hash_calls == []
    assert restarted.verify(store.models_dir / SMOLLM2_FILE_NAME, SMOLLM2_SHA256.upper())
    assert not restarted.verify(store.models_dir / SMOLLM2_FILE_NAME, "0" * 64)
    assert hash_calls == []


def test_real_model_to_proto(
    real_scan: tuple[ModelStore, list[LocalModel], list[tuple[int, int]]],
) -> None:
    _, models, _ = real_scan
    msg = pb.LocalModel.FromString(models[0].to_proto().SerializeToString())
    assert msg.sha256 == SMOLLM2_SHA256
    assert (msg.layers, msg.context_length, msg.architecture) == (30, 8192, "llama")
    assert msg.kv_bytes_per_token == 23_040
    assert msg.error == ""


def test_verify_sha256_real_model(smollm2_path: Path) -> None:
    assert verify_sha256(smollm2_path, SMOLLM2_SHA256)
    assert not verify_sha256(smollm2_path, "f" * 64)
    assert not verify_sha256(smollm2_path, "not-a-sha")
    assert not verify_sha256(smollm2_path.with_name("missing.gguf"), SMOLLM2_SHA256)


# --- cache behaviour on small files -------------------------------------------------------


def test_cache_hit_does_not_rehash(tmp_path: Path, hash_calls: list[Path]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "a.gguf")
    write_tiny_gguf(models / "b.GGUF", layers=2)
    (models / "notes.txt").write_text("not a model")

    first = ModelStore(models, tmp_path / "data", progress=None).scan()
    assert [m.file_name for m in first] == ["a.gguf", "b.GGUF"]
    assert len(hash_calls) == 2
    assert (tmp_path / "data" / CACHE_FILE_NAME).is_file()

    again = ModelStore(models, tmp_path / "data", progress=None).scan()
    assert again == first
    assert len(hash_calls) == 2


def test_mtime_change_rehashes(tmp_path: Path, hash_calls: list[Path]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    path = models / "a.gguf"
    write_tiny_gguf(path)
    store = ModelStore(models, tmp_path / "data", progress=None)
    before = store.scan()[0]
    assert len(hash_calls) == 1

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    after = store.scan()[0]
    assert len(hash_calls) == 2
    assert after.sha256 == before.sha256  # same bytes, re-verified

    write_tiny_gguf(path, layers=6, context=4096)  # content (and size/mtime) change
    changed = store.scan()[0]
    assert len(hash_calls) == 3
    assert changed.sha256 != before.sha256
    assert (changed.layers, changed.context_length) == (6, 4096)


def test_corrupt_cache_file_is_ignored(tmp_path: Path, hash_calls: list[Path]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "a.gguf")
    data = tmp_path / "data"
    data.mkdir()
    (data / CACHE_FILE_NAME).write_text("{not json")
    [model] = ModelStore(models, data, progress=None).scan()
    assert model.ok and len(hash_calls) == 1
    ModelStore(models, data, progress=None).scan()
    assert len(hash_calls) == 1  # rewritten cache is valid again


def test_removed_files_leave_the_cache(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "a.gguf")
    write_tiny_gguf(models / "b.gguf")
    store = ModelStore(models, tmp_path / "data", progress=None)
    store.scan()
    (models / "b.gguf").unlink()
    assert [m.file_name for m in store.scan()] == ["a.gguf"]
    text = (tmp_path / "data" / CACHE_FILE_NAME).read_text()
    assert "a.gguf" in text and "b.gguf" not in text


# --- bad files ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_bad",
    [
        lambda p: p.write_bytes(b"this is not a gguf file at all" * 100),
        lambda p: p.write_bytes(b""),
        lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40),  # truncated header
    ],
    ids=["garbage", "empty", "truncated"],
)
def test_bad_file_is_an_error_entry(
    tmp_path: Path, make_bad: Callable[[Path], object], hash_calls: list[Path]
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "good.gguf")
    make_bad(models / "bad.gguf")
    result = {m.file_name: m for m in ModelStore(models, tmp_path / "data", progress=None).scan()}
    bad = result["bad.gguf"]
    assert not bad.ok
    assert "GGUF" in bad.error
    assert bad.sha256 == "" and bad.layers == 0
    assert bad.to_proto().error == bad.error
    assert result["good.gguf"].ok
    assert hash_calls == [models / "good.gguf"]  # garbage is not hashed


def test_missing_models_dir_is_empty(tmp_path: Path) -> None:
    assert ModelStore(tmp_path / "nope", tmp_path / "data").scan() == []


def test_find_rejects_path_traversal(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "a.gguf")
    store = ModelStore(models, tmp_path / "data", progress=None)
    assert store.find("a.gguf") == (models / "a.gguf").absolute()
    assert store.find("../a.gguf") is None
    assert store.find("") is None
    assert store.find("b.gguf") is None


def test_store_verify_hashes_uncached_file(tmp_path: Path, hash_calls: list[Path]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    path = models / "a.gguf"
    write_tiny_gguf(path)
    expected = sha256_file(path)
    hash_calls.clear()
    store = ModelStore(models, tmp_path / "data", progress=None)
    assert store.verify(path, expected)
    assert store.verify(path, expected)
    assert len(hash_calls) == 1
    assert not store.verify(path, "x")


# --- metadata and helpers -------------------------------------------------------------------


def test_tiny_metadata_and_default_kv_heads(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, layers=4, embedding=64, heads=8, kv_heads=None)
    meta = read_gguf_metadata(path)
    assert meta.architecture == "llama"
    assert meta.parameters == 10 * 64 + 64 * 64
    # no head_count_kv: n_kv_heads = head_count = 8, head_dim = 8 -> 2 * 4 * 8 * 8 * 2
    assert meta.kv_bytes_per_token == 2 * 4 * 8 * 8 * 2


def test_kv_bytes_per_token_formula() -> None:
    assert kv_bytes_per_token(30, 576, 9, 3) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(2, 64, 8, [2, 0]) == 2 * (2 + 0) * 8 * 2
    assert kv_bytes_per_token(2, 64, 8, 2, key_length=16, value_length=8) == 2 * 2 * (16 + 8) * 2
    assert kv_bytes_per_token(0, 64, 8, 2) == 0


def test_sha256_file_progress_small_and_empty(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    seen: list[tuple[int, int]] = []
    assert sha256_file(empty, lambda _p, d, t: seen.append((d, t))) == (
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    assert seen == [(0, 0)]
