"""A GGUF file's own tokenizer, rebuilt with Hugging Face ``tokenizers`` so that the controller
counts a prompt's tokens as llama.cpp will, before any node sees the prompt.

llama.cpp reads the vocabulary from the file's ``tokenizer.ggml.*`` metadata and tokenizes in
two ways this module reproduces:

* byte-level BPE (``tokenizer.ggml.model`` ``gpt2``): the text is split by the regular
  expressions of its pre-tokenizer type (``tokenizer.ggml.pre``, each applied to the pieces of
  the one before, as ``unicode_regex_split`` does), each piece is byte-encoded and merged by
  rank; types that ``ignore_merges`` take a whole piece that is in the vocabulary as is;
* SentencePiece-style BPE (``llama``): spaces become ``▁``, one is put in front
  (``add_space_prefix``), pairs merge by the score of what they make, and a character outside
  the vocabulary falls back to its bytes (``<0xNN>``).

Control and user-defined tokens are matched in the text as themselves (llama-server tokenizes
prompts with ``parse_special``). The regular expressions and per-type flags below are
llama.cpp's (``src/llama-vocab.cpp``), for the types whose tokenizations the tests compare with
the reference ones llama.cpp ships (``models/ggml-vocab-*.gguf.out`` in its source). A type
that is not here is :class:`UnsupportedVocabulary`: the controller then does not count, and
the node's server refuses a prompt too long for it (the same 400).

Imports only the standard library and ``tokenizers`` (lazily).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: llama.cpp's token types (``llama_token_type`` / gguf's ``TokenType``).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[一-龥ࠀ-一가-퟿]+"


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's BPE pre-tokenizer types: its regular expressions, in order, and
    whether a piece already in the vocabulary skips the merges."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    #: llama.cpp puts a BOS in front for these types, whatever the file says.
    add_bos: bool | None = None


_TYPES: dict[str, PreTokenizer] = {
    "default": PreTokenizer(
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    ),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "gpt2": PreTokenizer((_GPT2,)),
    "smollm": PreTokenizer((r"\p{N}", _GPT2)),
    "qwen2": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "deepseek-coder": PreTokenizer(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    ),
}

#: ``tokenizer.ggml.pre`` names and the type llama.cpp gives each.
PRE_TYPES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"),
        "llama3",
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe"), "llama3-plain"),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "jina-es", "jina-de", "mpt", "olmo", "jais", "exaone4", "roberta-bpe"),
        "gpt2",
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        "smollm",
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), "qwen2"),
    "qwen35": "qwen35",
    "falcon": "falcon",
    "deepseek-coder": "deepseek-coder",
}
# The same expression as llama3's, without ignore_merges or a forced BOS.
_TYPES["llama3-plain"] = PreTokenizer((_LLAMA3,))


class UnsupportedVocabulary(ValueError):
    """A vocabulary whose tokenization this module cannot reproduce exactly."""


@dataclass(frozen=True)
class Vocabulary:
    """What llama.cpp's tokenizer reads from a GGUF file."""

    model: str
    pre: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float]
    merges: Sequence[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    add_space_prefix: bool | None
    chat_template: str

    def token(self, token_id: int | None) -> str:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return ""
        return self.tokens[token_id]


def read_vocabulary(path: Path | str) -> Vocabulary:
    """The ``tokenizer.*`` metadata of the GGUF file at ``path``."""
    fields = read_metadata(path, prefix="tokenizer.")

    def flag(key: str) -> bool | None:
        found = fields.get(key)
        return None if found is None else bool(found)

    bos = fields.get("tokenizer.ggml.bos_token_id")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return Vocabulary(
        model=str(fields.get("tokenizer.ggml.model") or ""),
        pre=str(fields.get("tokenizer.ggml.pre") or "default"),
        tokens=list(fields.get("tokenizer.ggml.tokens") or []),
        token_types=[int(t) for t in fields.get("tokenizer.ggml.token_type") or []],
        scores=[float(s) for s in fields.get("tokenizer.ggml.scores") or []],
        merges=list(fields.get("tokenizer.ggml.merges") or []),
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=flag("tokenizer.ggml.add_bos_token"),
        add_space_prefix=flag("tokenizer.ggml.add_space_prefix"),
        chat_template=str(fields.get("tokenizer.chat_template") or ""),
    )


_GGUF_MAGIC = b"GGUF"
#: GGUF value types with a fixed size, as ``struct`` formats (little-endian).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
#: A key or value no real file has (a corrupt one would have us read gigabytes).
_MAX_ITEMS = 1 << 24


def read_metadata(path: Path | str, prefix: str = "") -> dict[str, Any]:
    """The key-value metadata of a GGUF file (version 2 or 3) whose keys start with
    ``prefix``, read straight from its header: ``gguf.GGUFReader`` takes seconds over a
    vocabulary's hundred thousand strings, this a tenth of one. Raises ``ValueError`` for a
    file that is not GGUF."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, _tensors, count = struct.unpack_from("<IQQ", data, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        at = 24
        out: dict[str, Any] = {}

        def string() -> str:
            nonlocal at
            (size,) = struct.unpack_from("<Q", data, at)
            if size > len(data):
                raise ValueError(f"{path}: a string runs past the end of the file")
            text = data[at + 8 : at + 8 + size].decode("utf-8", errors="replace")
            at += 8 + size
            return text

        def value(kind: int, keep: bool) -> Any:
            nonlocal at
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, n = struct.unpack_from("<IQ", data, at)
                at += 12
                if n > _MAX_ITEMS:
                    raise ValueError(f"{path}: an array of {n} items")
                if item in _SCALARS:
                    fmt = f"<{n}{_SCALARS[item]}"
                    size = struct.calcsize(fmt)
                    items = list(struct.unpack_from(fmt, data, at)) if keep else None
                    at += size
                    return items
                return [value(item, keep) for _ in range(n)]
            fmt = "<" + _SCALARS[kind]
            (scalar,) = struct.unpack_from(fmt, data, at)
            at += struct.calcsize(fmt)
            return scalar

        for _ in range(count):
            key = string()
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4
            if kind not in _SCALARS and kind not in (_STRING, _ARRAY):
                raise ValueError(f"{path}: unknown GGUF value type {kind} at {key!r}")
            found = value(kind, key.startswith(prefix))
            if key.startswith(prefix):
                out[key] = found
        return out


@dataclass(frozen=True)
class GgufTokenizer:
    """Counts tokens as llama.cpp's ``common_tokenize(text, add_special, parse_special=true)``."""

    tokenizer: Tokenizer
    #: Whether llama.cpp puts the BOS token in front when asked for special tokens.
    add_bos: bool
    bos_token: str
    eos_token: str

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no BOS)."""
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        unknown = self.tokenizer.token_to_id(UNKNOWN_BYTE)
        return [i for i in ids if i != unknown] if unknown is not None else list(ids)

    #: Whether the vocabulary is SentencePiece-style: it puts a space in front of every piece
    #: of text between special tokens, which a token may then cover alone.
    space_prefix: bool = False

    def upper_bound(self, text: str) -> int:
        """At least :meth:`count` of ``text``, without tokenizing: a byte-level token covers
        at least one byte; a SentencePiece one at least one character of the text with its
        space prefixes (at most one per character, counting the special tokens')."""
        size = len(text.encode("utf-8"))
        return (2 * size + 1 if self.space_prefix else size) + 1

    def count(self, text: str, add_special: bool = True) -> int:
        """How many tokens llama.cpp makes of ``text``, with the BOS if ``add_special``."""
        return len(self.encode(text)) + (1 if add_special and self.add_bos else 0)


def tokenizer_for(vocab: Vocabulary) -> GgufTokenizer:
    """The tokenizer ``vocab`` describes; :class:`UnsupportedVocabulary` when llama.cpp's
    tokenization of it is not one this module reproduces."""
    space_prefix = False
    if vocab.model == "gpt2":
        kind = PRE_TYPES.get(vocab.pre)
        if kind is None:
            raise UnsupportedVocabulary(f"pre-tokenizer {vocab.pre!r}")
        pre = _TYPES[kind]
        tokenizer = _byte_level_bpe(vocab, pre)
        default_bos = pre.add_bos if pre.add_bos is not None else False
        add_bos = default_bos if vocab.add_bos is None or pre.add_bos else vocab.add_bos
    elif vocab.model == "llama":
        tokenizer = _sentencepiece_bpe(vocab)
        add_bos = True if vocab.add_bos is None else vocab.add_bos
        space_prefix = vocab.add_space_prefix is not False
    else:
        raise UnsupportedVocabulary(f"tokenizer model {vocab.model!r}")
    _add_special_tokens(tokenizer, vocab)
    return GgufTokenizer(
        tokenizer,
        add_bos,
        vocab.token(vocab.bos_id),
        vocab.token(vocab.eos_id),
        space_prefix=space_prefix,
    )


def _special(vocab: Vocabulary) -> list[str]:
    """The tokens llama.cpp matches in a prompt as themselves (control and user-defined)."""
    types = vocab.token_types
    return [
        token
        for i, token in enumerate(vocab.tokens)
        if i < len(types) and types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and token
    ]


def _add_special_tokens(tokenizer: Tokenizer, vocab: Vocabulary) -> None:
    from tokenizers import AddedToken

    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in _special(vocab)]
    )


#: The byte-level tokenizer's stand-in for a byte its vocabulary lacks (never in the output).
UNKNOWN_BYTE = "<dacp:unknown-byte>"


def _byte_level_bpe(vocab: Vocabulary, pre: PreTokenizer) -> Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges: list[tuple[str, str]] = []
    for merge in vocab.merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise UnsupportedVocabulary(f"merge {merge!r} is not two tokens")
        merges.append((left, right))
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    # A byte the vocabulary has no token for: llama.cpp keeps it as a symbol of its own while
    # merging (so ``+`` and ``=`` around it stay apart) and drops it from the ids; so does an
    # unknown token here, which GgufTokenizer.encode leaves out.
    ids[UNKNOWN_BYTE] = len(vocab.tokens)
    model = models.BPE(
        vocab=ids,
        merges=merges,
        ignore_merges=pre.ignore_merges,
        unk_token=UNKNOWN_BYTE,
        fuse_unk=False,
    )
    tokenizer = Tokenizer(model)
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes
    ]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(vocab: Vocabulary) -> Tokenizer:
    """llama.cpp's SPM tokenizer as a BPE: the merge of a pair ranks by the score of the token
    it makes (higher first), and characters outside the vocabulary fall back to bytes."""
    from tokenizers import Tokenizer, models, normalizers

    ids = {token: i for i, token in enumerate(vocab.tokens)}
    scores = vocab.scores or [0.0] * len(vocab.tokens)
    ranked: list[tuple[float, int, str, str]] = []
    for token, i in ids.items():
        if i < len(vocab.token_types) and vocab.token_types[i] != TOKEN_NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    unknown = next(
        (t for i, t in enumerate(vocab.tokens) if vocab.token_types[i] == TOKEN_UNKNOWN), None
    )
    model = models.BPE(
        vocab=ids,
        merges=[(left, right) for _, _, left, right in ranked],
        byte_fallback=True,
        unk_token=unknown,
        fuse_unk=True,
    )
    tokenizer = Tokenizer(model)
    steps: list[normalizers.Normalizer] = []
    if vocab.add_space_prefix is not False:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    return tokenizer
