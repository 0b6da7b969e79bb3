"""A llama model with random weights, written with the ``gguf`` package: what ``ops.gpu_check``
serves on a machine that cannot download a real one (the 98 MB test model does not fit in the
64 MiB a device machine's command carries).

It keeps SmolLM2's tokenizer and architecture family: :func:`extract_tokenizer` copies the test
model's ``tokenizer.*`` metadata (vocabulary, merges, token types, special token ids, chat
template) into a small GGUF without tensors, and :func:`write_model` writes a llama of about the
asked parameter count around it, in F16. Its shape follows SmolLM2's (64-wide attention heads,
a feed-forward four times the width): :func:`choose_shape` takes the widest one that still has
:data:`MIN_LAYERS` layers.

The output matrix is its own tensor, with the rows of every non-normal token (``<|im_end|>``,
``<|endoftext|>``, ...) zero: random logits never make such a token the greedy choice, so every
request generates the ``max_tokens`` it asks for and the decode rate is measured over all of
them.

Imports ``gguf`` and ``numpy`` only when a file is read or written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURE = "llama"
TOKENIZER_PREFIX = "tokenizer."
VOCAB_KEY = "tokenizer.ggml.tokens"
TOKEN_TYPE_KEY = "tokenizer.ggml.token_type"
#: ``tokenizer.ggml.token_type`` of an ordinary token (llama.cpp's LLAMA_TOKEN_TYPE_NORMAL).
NORMAL_TOKEN = 1
HEAD_DIM = 64
FFN_FACTOR = 4
#: Widths tried, widest first (SmolLM2's family spans 576 to 2048).
WIDTHS = (2048, 1536, 1024, 768, 512, 384, 256, 192, 128, 64)
MIN_LAYERS = 8
CONTEXT_LENGTH = 8192
ROPE_FREQ_BASE = 100_000.0
RMS_EPSILON = 1e-5
WEIGHT_STD = 0.02
GGUF_FILE_TYPE_F16 = 1  # general.file_type: LLAMA_FTYPE_MOSTLY_F16
SEED = 22


class ModelError(RuntimeError):
    """The shape cannot be made or a file cannot be read or written; one line."""


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Every weight: token embeddings, output matrix, layers, final norm."""
        kv = self.kv_heads * self.head_dim
        attention = self.hidden * (2 * self.hidden + 2 * kv)
        per_layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * per_layer + self.hidden

    @property
    def label(self) -> str:
        return f"{self.params / 1e9:.2f}B" if self.params >= 1e9 else f"{self.params / 1e6:.0f}M"

    @property
    def file_name(self) -> str:
        return f"random-llama-{self.hidden}x{self.layers}-v{self.vocab}.f16.gguf"

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Each tensor's name and shape in NumPy order (rows, columns), in file order."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        yield "token_embd.weight", (self.vocab, h)
        for i in range(self.layers):
            yield f"blk.{i}.attn_norm.weight", (h,)
            yield f"blk.{i}.attn_q.weight", (h, h)
            yield f"blk.{i}.attn_k.weight", (kv, h)
            yield f"blk.{i}.attn_v.weight", (kv, h)
            yield f"blk.{i}.attn_output.weight", (h, h)
            yield f"blk.{i}.ffn_norm.weight", (h,)
            yield f"blk.{i}.ffn_gate.weight", (self.ffn, h)
            yield f"blk.{i}.ffn_up.weight", (self.ffn, h)
            yield f"blk.{i}.ffn_down.weight", (h, self.ffn)
        yield "output_norm.weight", (h,)
        yield "output.weight", (self.vocab, h)


def shape_for(hidden: int, layers: int, vocab: int) -> ModelShape:
    heads = max(1, hidden // HEAD_DIM)
    return ModelShape(vocab, hidden, layers, FFN_FACTOR * hidden, heads, heads)


def choose_shape(params: float, vocab: int) -> ModelShape:
    """The widest :data:`WIDTHS` shape with at least :data:`MIN_LAYERS` layers whose size is
    nearest ``params``; the narrowest if none has that many."""
    if params <= 0 or vocab <= 0:
        raise ModelError(f"a model needs a positive size and vocabulary, got {params:g}, {vocab}")
    for hidden in WIDTHS:
        empty = shape_for(hidden, 0, vocab)
        per_layer = shape_for(hidden, 1, vocab).params - empty.params
        layers = round((params - empty.params) / per_layer)
        if layers >= MIN_LAYERS or hidden == WIDTHS[-1]:
            if layers < 1:
                smallest = shape_for(hidden, 1, vocab).params
                raise ModelError(
                    f"--params {params:g} is below the smallest model with this vocabulary "
                    f"({smallest:.3g} parameters)"
                )
            return shape_for(hidden, layers, vocab)
    raise AssertionError("unreachable")


# --- the tokenizer ----------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One GGUF metadata entry: its value and type (and the items' type for an array)."""

    key: str
    value: Any
    type: int
    sub_type: int | None = None


def read_fields(path: Path, prefix: str = "") -> list[Field]:
    """The metadata entries of the GGUF at ``path`` whose key starts with ``prefix``."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith(prefix) or not field.types:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        fields.append(Field(key, field.contents(), int(field.types[0]), sub and int(sub)))
    return fields


def _add_fields(writer: Any, fields: list[Field]) -> None:
    import gguf

    for f in fields:
        sub = gguf.GGUFValueType(f.sub_type) if f.sub_type is not None else None
        writer.add_key_value(f.key, f.value, gguf.GGUFValueType(f.type), sub_type=sub)


def extract_tokenizer(model: Path, dest: Path) -> int:
    """Write the ``tokenizer.*`` metadata of the GGUF ``model`` to ``dest``, a GGUF without
    tensors; return how many entries it holds."""
    import gguf

    fields = read_fields(model, TOKENIZER_PREFIX)
    if not any(f.key == VOCAB_KEY for f in fields):
        raise ModelError(f"{model} has no {VOCAB_KEY}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    writer = gguf.GGUFWriter(partial, ARCHITECTURE)
    _add_fields(writer, fields)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    partial.replace(dest)
    return len(fields)


def vocab_size(tokenizer: Path) -> int:
    for f in read_fields(tokenizer, VOCAB_KEY):
        if f.key == VOCAB_KEY:
            return len(f.value)
    raise ModelError(f"{tokenizer} has no {VOCAB_KEY}")


# --- the model --------------------------------------------------------------------------


def write_model(
    tokenizer: Path,
    shape: ModelShape,
    dest: Path,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight F16 llama of ``shape`` with ``tokenizer``'s metadata to ``dest``
    (through a ``.partial`` file); ``progress(done_bytes, total_bytes)`` after each tensor.
    The weights are slices of one random pool, so a 2 GB model takes seconds."""
    import gguf
    import numpy as np

    fields = read_fields(tokenizer, TOKENIZER_PREFIX)
    types = next((f.value for f in fields if f.key == TOKEN_TYPE_KEY), None)
    vocab = next((len(f.value) for f in fields if f.key == VOCAB_KEY), 0)
    if vocab != shape.vocab:
        raise ModelError(f"{tokenizer} has {vocab} tokens; the shape has {shape.vocab}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    writer = gguf.GGUFWriter(partial, ARCHITECTURE)
    writer.add_name(f"random llama {shape.label} (ops.random_model, SmolLM2 tokenizer)")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPSILON)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(GGUF_FILE_TYPE_F16)
    _add_fields(writer, fields)
    tensors = list(shape.tensors())
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    rng = np.random.default_rng(SEED)
    largest = max(int(np.prod(d)) for _, d in tensors)
    pool = (rng.standard_normal(largest, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
    special = np.array([t != NORMAL_TOKEN for t in types or []], dtype=bool)
    total = sum(int(np.prod(d)) * (4 if len(d) == 1 else 2) for _, d in tensors)
    done = 0
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, dims in tensors:
            count = int(np.prod(dims))
            data: Any
            if len(dims) == 1:
                data = np.ones(dims, dtype=np.float32)
            else:
                start = int(rng.integers(0, largest - count + 1))
                data = pool[start : start + count].reshape(dims)
                if name == "output.weight" and special.any():
                    data = data.copy()
                    data[special[: dims[0]]] = 0
            writer.write_tensor_data(data)
            done += data.nbytes
            if progress is not None:
                progress(done, total)
    finally:
        writer.close()
    partial.replace(dest)
    return dest


class Progress:
    """``progress`` for :func:`write_model`: a line every 10 percent, with the elapsed time."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.started = time.monotonic()
        self.next_step = 10

    def __call__(self, done: int, total: int) -> None:
        percent = 100 * done // total if total else 100
        if percent >= self.next_step:
            elapsed = time.monotonic() - self.started
            self.say(f"  writing {percent:3d}% ({done >> 20} MiB, {elapsed:.1f}s)")
            self.next_step = percent - percent % 10 + 10
