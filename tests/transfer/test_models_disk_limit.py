"""``--models-disk-limit``: a fetch whose model would take the models directory beyond the limit
fails before a byte is written, naming the sizes and how to make room, and leaves nothing
behind. The same real node A (a ModelFileServer over TLS) and http(s) source as the other
transfer tests; node B fetches with a :class:`DiskLimit`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.models.model_fetch import DiskLimit, Source, TransferError, fetch, partial_path
from agent.models.model_transfers import ModelTransfers
from tests.transfer import test_model_transfer as base
from tests.transfer.test_model_transfer import LOOPBACK, SIZE, Pair
from wire import control_pb2 as pb

#: The fixtures of the other transfer tests: node A serving a model, an http(s) source of it.
pair = base.pair
url_server = base.url_server

MIB = 1 << 20


def _refused(pair: Pair, dest: Path, limit: DiskLimit, source: Source | None = None) -> str:
    context = pair.b_tls.client_context(pair.ca_pem)
    size = 0 if source is not None else SIZE
    with pytest.raises(TransferError) as refused:
        fetch(
            source or pair.source(), pair.sha256, size, dest, context, limit=limit, allowed=LOOPBACK
        )
    assert not refused.value.retry  # another source would not fit either
    assert not dest.exists() and not partial_path(dest).exists()
    return str(refused.value)


def test_a_limit_too_small_for_the_model_fails_clearly_and_leaves_nothing(
    pair: Pair, tmp_path: Path
) -> None:
    models = tmp_path / "b-models"
    models.mkdir()
    dest = models / "model.gguf"
    partial_path(dest).write_bytes(pair.path.read_bytes()[:MIB])  # an earlier attempt
    message = _refused(pair, dest, DiskLimit(SIZE - 1, "gpu-box-2"))
    assert message == (
        f"model.gguf needs {SIZE} bytes (24.0 MiB), beyond --models-disk-limit {SIZE - 1} "
        f"bytes (24.0 MiB): the model files in {models} hold 0 bytes, leaving {SIZE - 1} "
        "bytes (24.0 MiB); raise --models-disk-limit"
    )
    assert os.listdir(models) == []
    assert pair.server.bytes_sent == 0


def test_the_model_files_there_count_against_the_limit(pair: Pair, tmp_path: Path) -> None:
    models = tmp_path / "b-models"
    models.mkdir()
    (models / "other.gguf").write_bytes(b"\0" * (10 * MIB))
    (models / "third.GGUF").write_bytes(b"\0" * (2 * MIB))
    (models / "cut.gguf.partial").write_bytes(b"\0" * (4 * MIB))  # another fetch's
    (models / "notes.txt").write_bytes(b"\0" * (8 * MIB))  # not a model file: not counted
    limit = DiskLimit(SIZE + 12 * MIB, "gpu-box-2")  # room for the model and 12 MiB more
    message = _refused(pair, models / "model.gguf", limit)
    assert message.startswith(
        f"model.gguf needs {SIZE} bytes (24.0 MiB), beyond --models-disk-limit "
        f"{SIZE + 12 * MIB} bytes (36.0 MiB): the model files in {models} hold "
        f"{16 * MIB} bytes (16.0 MiB), leaving {20 * MIB} bytes (20.0 MiB); "
    )
    assert message.endswith(
        "make room (dacp models evict MODEL --node gpu-box-2) or raise --models-disk-limit"
    )
    assert sorted(os.listdir(models)) == [
        "cut.gguf.partial",
        "notes.txt",
        "other.gguf",
        "third.GGUF",
    ]
    assert pair.server.bytes_sent == 0


def test_a_fetch_under_way_counts_at_its_whole_size(pair: Pair, tmp_path: Path) -> None:
    models = tmp_path / "b-models"
    models.mkdir()
    limit = DiskLimit(SIZE + 8 * MIB)
    growing = models / "growing.gguf"
    limit.reserve(growing, 16 * MIB)  # another fetch, its partial file not written yet
    assert "hold 16777216 bytes (16.0 MiB)" in _refused(pair, models / "model.gguf", limit)
    limit.release(growing)
    fetch(
        pair.source(),
        pair.sha256,
        SIZE,
        models / "model.gguf",
        pair.b_tls.client_context(pair.ca_pem),
        limit=limit,
    )
    assert (models / "model.gguf").read_bytes() == pair.path.read_bytes()


def test_a_limit_with_room_lets_the_fetch_through(pair: Pair, tmp_path: Path) -> None:
    models = tmp_path / "b-models"
    models.mkdir()
    (models / "other.gguf").write_bytes(b"\0" * (10 * MIB))
    dest = models / "model.gguf"
    partial_path(dest).write_bytes(pair.path.read_bytes()[: 5 * MIB])  # resumed, not counted twice
    limit = DiskLimit(SIZE + 10 * MIB)  # exactly enough
    fetch(
        pair.source(), pair.sha256, SIZE, dest, pair.b_tls.client_context(pair.ca_pem), limit=limit
    )
    assert dest.read_bytes() == pair.path.read_bytes()
    assert pair.server.bytes_sent == SIZE - 5 * MIB
    assert limit.used(models) == SIZE + 10 * MIB  # the fetch is no longer counted on its own


def test_a_url_source_is_checked_once_its_answer_gives_the_size(
    pair: Pair, url_server: str, tmp_path: Path
) -> None:
    models = tmp_path / "b-models"
    models.mkdir()
    dest = models / "model.gguf"
    partial_path(dest).write_bytes(pair.path.read_bytes()[: 3 * MIB])  # a cut attempt
    source = Source("", "", 0, "", url_server)
    message = _refused(pair, dest, DiskLimit(SIZE - MIB), source)
    assert message.startswith(f"model.gguf needs {SIZE} bytes (24.0 MiB), beyond")
    assert os.listdir(models) == []
    limit = DiskLimit(SIZE)
    context = pair.b_tls.client_context(pair.ca_pem)
    fetch(source, pair.sha256, 0, dest, context, limit=limit, allowed=LOOPBACK)
    assert dest.read_bytes() == pair.path.read_bytes()


async def test_the_agent_reports_the_refusal_and_tries_no_other_source(
    pair: Pair, tmp_path: Path
) -> None:
    models = tmp_path / "b-models"
    # The node's own transfers, with B's certificate (its data directory) and the limit.
    transfers = ModelTransfers(
        models,
        tmp_path / pair.b,
        "127.0.0.1",
        0,
        on_model_added=lambda: None,
        disk_limit=SIZE // 2,
        node_name="gpu-box-2",
    )
    transfers.ca_pem = pair.ca_pem
    source = pb.TransferSource(
        node_id=pair.a, host="127.0.0.1", port=pair.server.port, ticket=pair.ticket()
    )
    msg = pb.FetchModel(
        transfer_id="t1",
        model_sha256=pair.sha256,
        file_name="model.gguf",
        size_bytes=SIZE,
        sources=[source, source],
    )
    sent: list[pb.AgentMessage] = []

    async def send(message: pb.AgentMessage) -> None:
        sent.append(message)

    await transfers.on_fetch(msg, send)
    states = [m.model_transfer.state for m in sent]
    assert states == [pb.ModelTransfer.STARTED, pb.ModelTransfer.FAILED]
    assert "beyond --models-disk-limit" in sent[-1].model_transfer.error
    assert not models.exists() or os.listdir(models) == []
    assert pair.server.bytes_sent == 0
