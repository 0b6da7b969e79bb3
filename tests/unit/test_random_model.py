"""ops.random_model: the shape for a parameter count, the tokenizer's metadata carried alone,
and a random-weight llama written around it that llama.cpp's metadata reader accepts."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from common.gguf_metadata import read_gguf_metadata
from ops import random_model
from ops.random_model import ModelError, ModelShape

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *[f"t{i}" for i in range(61)]]
TYPES = [3, 3, 3, *[1] * 61]


def _source_model(path: Path) -> Path:
    """A GGUF with a tokenizer and a field that must not travel."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("source")
    writer.add_block_count(30)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TYPES)
    writer.add_token_merges(["t 0", "t 1"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("params", [1.0e9, 5.0e7, 1.5e8])
def test_the_shape_is_near_the_asked_size_with_enough_layers(params: float) -> None:
    shape = random_model.choose_shape(params, 49152)
    assert shape.params == pytest.approx(params, rel=0.03)
    assert shape.layers >= random_model.MIN_LAYERS
    assert shape.head_dim == random_model.HEAD_DIM
    assert shape.ffn == random_model.FFN_FACTOR * shape.hidden


def test_the_one_billion_default_is_smollm2_wide() -> None:
    shape = random_model.choose_shape(1.0e9, 49152)
    assert (shape.hidden, shape.layers, shape.label) == (2048, 12, "1.01B")


def test_a_size_below_the_embeddings_is_refused() -> None:
    with pytest.raises(ModelError, match="below the smallest model"):
        random_model.choose_shape(1e6, 49152)
    with pytest.raises(ModelError):
        random_model.choose_shape(0, 49152)


def test_only_the_tokenizer_travels(tmp_path: Path) -> None:
    source = _source_model(tmp_path / "source.gguf")
    count = random_model.extract_tokenizer(source, tmp_path / "tokenizer.gguf")
    fields = random_model.read_fields(tmp_path / "tokenizer.gguf")
    keys = {f.key for f in fields}
    assert count == len([k for k in keys if k.startswith("tokenizer.")]) == 7
    assert "general.name" not in keys and "llama.block_count" not in keys
    assert random_model.vocab_size(tmp_path / "tokenizer.gguf") == len(TOKENS)
    tokens = next(f.value for f in fields if f.key == random_model.VOCAB_KEY)
    assert tokens == TOKENS


def test_a_model_without_a_vocabulary_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"no tokenizer\.ggml\.tokens"):
        random_model.extract_tokenizer(tmp_path / "bare.gguf", tmp_path / "t.gguf")


def test_the_written_model_has_its_shape_and_never_favours_a_special_token(
    tmp_path: Path,
) -> None:
    tokenizer = tmp_path / "tokenizer.gguf"
    random_model.extract_tokenizer(_source_model(tmp_path / "source.gguf"), tokenizer)
    shape = random_model.shape_for(hidden=64, layers=2, vocab=len(TOKENS))
    seen: list[tuple[int, int]] = []
    path = random_model.write_model(
        tokenizer, shape, tmp_path / shape.file_name, progress=lambda d, t: seen.append((d, t))
    )
    meta = read_gguf_metadata(path)
    assert (meta.architecture, meta.layers, meta.parameters) == ("llama", 2, shape.params)
    assert meta.embedding_length == 64
    assert seen[-1][0] == seen[-1][1]
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == len(list(shape.tensors()))
    output = next(t for t in reader.tensors if t.name == "output.weight")
    rows = np.asarray(output.data).reshape(len(TOKENS), 64)
    special = [i for i, kind in enumerate(TYPES) if kind != random_model.NORMAL_TOKEN]
    assert not rows[special].any()
    assert rows[[i for i in range(len(TOKENS)) if i not in special]].any(axis=1).all()
    assert reader.fields["tokenizer.chat_template"].contents().startswith("{% for m")
    assert not (tmp_path / (shape.file_name + ".partial")).exists()


def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.gguf"
    random_model.extract_tokenizer(_source_model(tmp_path / "source.gguf"), tokenizer)
    wrong = ModelShape(vocab=100, hidden=64, layers=1, ffn=256, heads=1, kv_heads=1)
    with pytest.raises(ModelError, match="has 64 tokens; the shape has 100"):
        random_model.write_model(tokenizer, wrong, tmp_path / "m.gguf")
