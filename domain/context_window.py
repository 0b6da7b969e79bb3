"""The context a job really gets: how many tokens of prompt one llama-server slot holds.

The agent starts a chat server with ``--ctx-size`` = the plan's context x its slots and no
unified KV cache, so each slot holds its own share. llama.cpp rounds both the whole cache and
each slot's share up to a multiple of :data:`LLAMA_CTX_PAD` tokens, and caps a slot at the
model's training context (``llama_context`` and ``n_ctx_slot`` in llama-server); the share
then comes out as the plan's context rounded up, whatever the slot count. A prompt fits only
with room for one token of answer: llama-server refuses one of ``n_ctx`` tokens or more.
"""

from __future__ import annotations

#: llama.cpp pads context sizes to a multiple of this (``GGML_PAD(n_ctx, 256)``).
LLAMA_CTX_PAD = 256


def slot_context(context_size: int, training_context: int = 0) -> int:
    """The tokens one slot holds for a model served with ``context_size`` per slot;
    ``training_context`` (0: not known) caps it, as llama.cpp does."""
    if context_size < 1:
        raise ValueError(f"context_size must be positive, got {context_size}")
    padded = -(-context_size // LLAMA_CTX_PAD) * LLAMA_CTX_PAD
    return min(padded, training_context) if training_context > 0 else padded


def fits(prompt_tokens: int, context: int) -> bool:
    """Whether a prompt of ``prompt_tokens`` leaves a slot of ``context`` room to answer."""
    return prompt_tokens < context
