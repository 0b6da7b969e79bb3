"""The context a job gets, as llama.cpp sizes a slot (domain/context_window.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from domain.context_window import LLAMA_CTX_PAD, fits, slot_context


def _pad(n: int) -> int:
    return -(-n // LLAMA_CTX_PAD) * LLAMA_CTX_PAD


def llama_cpp_slot(per_slot: int, slots: int, training: int) -> int:
    """llama.cpp's own steps for ``--ctx-size per_slot*slots --parallel slots`` without a
    unified cache: the whole cache padded, divided, the share padded, capped by training."""
    n_ctx = _pad(per_slot * slots)
    share = _pad(n_ctx // slots)
    return min(share, training) if training else share


def test_a_multiple_of_256_is_the_context_itself() -> None:
    assert slot_context(2048) == 2048
    assert slot_context(4096, training_context=8192) == 4096


def test_other_sizes_round_up_and_the_training_context_caps() -> None:
    assert slot_context(2000) == 2048
    assert slot_context(1) == 256
    assert slot_context(16384, training_context=8192) == 8192


@given(
    per_slot=st.integers(1, 200_000),
    slots=st.integers(1, 16),
    training=st.sampled_from([0, 512, 2048, 8192, 131072]),
)
def test_the_share_is_the_same_whatever_the_slot_count(
    per_slot: int, slots: int, training: int
) -> None:
    assert slot_context(per_slot, training) == llama_cpp_slot(per_slot, slots, training)


def test_a_prompt_fits_only_with_room_for_one_token_of_answer() -> None:
    assert fits(2047, 2048)
    assert not fits(2048, 2048)
