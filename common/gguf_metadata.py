"""A GGUF file's shape: architecture, parameters, layers, training context, KV-cache bytes
per token and embedding length, read with ``gguf.GGUFReader``. The agent reports it for the
files it holds; the controller reads it for the files in its own model store. Both must
agree, so it lives here, with the wire contract.

Imports only the standard library and ``gguf`` (lazily: it pulls in numpy).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KV_CACHE_BYTES_PER_ELEMENT = 2  # f16 K and V (llama.cpp's default cache type)


@dataclass(frozen=True)
class GgufMetadata:
    architecture: str
    parameters: int
    layers: int
    context_length: int
    kv_bytes_per_token: int
    #: The length of the model's vectors (what its embeddings have).
    embedding_length: int = 0


def _field_value(fields: dict[str, Any], key: str) -> Any:
    field = fields.get(key)
    if field is None:
        return None
    return field.contents()


def _int_value(fields: dict[str, Any], key: str) -> int | None:
    value = _field_value(fields, key)
    if value is None:
        return None
    if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv in OpenELM)
        return int(max(value)) if value else None
    return int(value)


def kv_bytes_per_token(
    layers: int,
    embedding_length: int,
    head_count: int,
    head_count_kv: int | Iterable[int] | None = None,
    key_length: int | None = None,
    value_length: int | None = None,
) -> int:
    """Bytes of f16 KV cache one token of context costs across all layers.

    ``2 (K and V) * n_layers * n_kv_heads * head_dim * 2 bytes``, with head_dim =
    embedding_length / head_count unless the model states explicit key/value lengths.
    ``head_count_kv`` may be per-layer (a list); it defaults to ``head_count`` (no GQA).
    """
    if layers <= 0 or head_count <= 0:
        return 0
    head_dim = embedding_length // head_count
    k_dim = key_length or head_dim
    v_dim = value_length or head_dim
    if head_count_kv is None:
        kv_heads_total = head_count * layers
    elif isinstance(head_count_kv, int):
        kv_heads_total = head_count_kv * layers
    else:
        per_layer = [int(n) for n in head_count_kv]
        kv_heads_total = sum(per_layer[:layers]) if per_layer else head_count * layers
    return kv_heads_total * (k_dim + v_dim) * KV_CACHE_BYTES_PER_ELEMENT


def read_gguf_metadata(path: Path | str) -> GgufMetadata:
    """Architecture, parameter count, layers, training context and KV bytes/token.

    Raises ``ValueError`` (or another exception from ``gguf``) for a non-GGUF/corrupt file.
    """
    import gguf  # heavy import (numpy); only needed when a file must be parsed

    reader = gguf.GGUFReader(str(path), "r")
    fields: dict[str, Any] = dict(reader.fields)
    arch_value = _field_value(fields, "general.architecture")
    if not isinstance(arch_value, str) or not arch_value:
        raise ValueError("GGUF has no general.architecture")
    arch = arch_value
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    layers = _int_value(fields, f"{arch}.block_count") or 0
    context_length = _int_value(fields, f"{arch}.context_length") or 0
    embedding = _int_value(fields, f"{arch}.embedding_length") or 0
    heads = _int_value(fields, f"{arch}.attention.head_count") or 0
    raw_kv_heads = _field_value(fields, f"{arch}.attention.head_count_kv")
    kv_heads: int | list[int] | None
    if isinstance(raw_kv_heads, list):
        kv_heads = [int(n) for n in raw_kv_heads]
    elif raw_kv_heads is None:
        kv_heads = None
    else:
        kv_heads = int(raw_kv_heads)
    kv_bytes = kv_bytes_per_token(
        layers=layers,
        embedding_length=embedding,
        head_count=heads,
        head_count_kv=kv_heads,
        key_length=_int_value(fields, f"{arch}.attention.key_length"),
        value_length=_int_value(fields, f"{arch}.attention.value_length"),
    )
    return GgufMetadata(
        architecture=arch,
        parameters=parameters,
        layers=layers,
        context_length=context_length,
        kv_bytes_per_token=kv_bytes,
        embedding_length=embedding,
    )
