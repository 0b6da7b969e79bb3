"""A GGUF file's tokenizer metadata, read from its header (infrastructure/gguf_tokenizer.py);
the tokenizations themselves are compared with llama.cpp's in
tests/integration/test_gguf_tokenizer_reference.py and tests/e2e/test_prompt_counts.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from infrastructure.gguf_tokenizer import (
    UnsupportedVocabulary,
    Vocabulary,
    read_metadata,
    read_vocabulary,
    tokenizer_for,
)

TOKENS = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġa"]


def write(path: Path, model: str = "gpt2", pre: str = "gpt-2") -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 4096)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 1, 1, 1, 1, 1])
    writer.add_token_scores([0.0, 0.0, -1.0, -2.0, -0.5, -3.0, -0.25])
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_float64("general.ratio", 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = write(tmp_path / "m.gguf")
    mine = read_metadata(path)
    theirs = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    for key in ("llama.context_length", "general.ratio", "tokenizer.ggml.tokens"):
        assert mine[key] == theirs[key]
    assert mine["tokenizer.ggml.scores"] == pytest.approx(theirs["tokenizer.ggml.scores"])
    assert read_metadata(path, prefix="tokenizer.chat").keys() == {"tokenizer.chat_template"}


def test_the_vocabulary_has_what_llama_cpp_reads(tmp_path: Path) -> None:
    vocab = read_vocabulary(write(tmp_path / "m.gguf"))
    assert (vocab.model, vocab.pre, list(vocab.tokens)) == ("gpt2", "gpt-2", TOKENS)
    assert list(vocab.merges) == ["a b", "Ġ a"]
    assert (vocab.bos_id, vocab.eos_id, vocab.add_bos, vocab.add_space_prefix) == (
        0,
        1,
        True,
        False,
    )
    assert vocab.chat_template == "{{ messages[0]['content'] }}"


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_metadata(path)


def test_byte_level_bpe_merges_and_matches_control_tokens_as_themselves(tmp_path: Path) -> None:
    tokenizer = tokenizer_for(read_vocabulary(write(tmp_path / "m.gguf")))
    assert tokenizer.encode("ab a") == [4, 6]
    assert tokenizer.encode("<s>ab</s>") == [0, 4, 1]
    assert tokenizer.count("ab a") == 3  # the file asks for a BOS
    assert tokenizer.upper_bound("ab a") >= tokenizer.count("ab a")


def test_a_tokenization_not_reproduced_here_is_named(tmp_path: Path) -> None:
    vocab = read_vocabulary(write(tmp_path / "m.gguf", pre="deepseek-llm"))
    with pytest.raises(UnsupportedVocabulary, match="deepseek-llm"):
        tokenizer_for(vocab)
    bert = Vocabulary("bert", "default", TOKENS, [1] * 7, [], [], None, None, None, None, "")
    with pytest.raises(UnsupportedVocabulary, match="bert"):
        tokenizer_for(bert)
