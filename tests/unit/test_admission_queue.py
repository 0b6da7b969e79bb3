"""AdmissionQueue bookkeeping: FIFO per model, only the head is woken, bounded size."""

from __future__ import annotations

import pytest

from application.admission import AdmissionQueue, QueueFullError


def test_positions_count_from_one_per_model() -> None:
    queue = AdmissionQueue()
    a1, a2, b1 = queue.join("a", "j1"), queue.join("a", "j2"), queue.join("b", "j3")
    assert (a1.position, a2.position, b1.position) == (1, 2, 1)
    assert queue.depths() == {"a": 2, "b": 1}
    assert len(queue) == 3


def test_only_the_head_is_woken_and_leaving_wakes_the_next() -> None:
    queue = AdmissionQueue()
    first, second = queue.join("m", "j1"), queue.join("m", "j2")
    assert first.wakeup.is_set() and not second.wakeup.is_set()
    assert queue.is_head(first) and not queue.is_head(second)
    first.wakeup.clear()
    queue.wake("m")
    assert first.wakeup.is_set() and not second.wakeup.is_set()
    queue.leave(first)
    assert queue.is_head(second) and second.wakeup.is_set()


def test_leaving_from_the_middle_keeps_the_order_and_wakes_nobody() -> None:
    queue = AdmissionQueue()
    first, middle, last = (queue.join("m", f"j{i}") for i in range(3))
    first.wakeup.clear()
    queue.leave(middle)
    assert queue.is_head(first) and not first.wakeup.is_set() and not last.wakeup.is_set()
    queue.leave(middle)  # idempotent
    assert queue.depth("m") == 2


def test_wake_without_a_model_wakes_every_head() -> None:
    queue = AdmissionQueue()
    a, b = queue.join("a", "j1"), queue.join("b", "j2")
    a.wakeup.clear()
    b.wakeup.clear()
    queue.wake()
    assert a.wakeup.is_set() and b.wakeup.is_set()
    queue.wake("unknown")  # no queue, nothing to do


def test_the_bound_counts_every_model_and_frees_on_leave() -> None:
    queue = AdmissionQueue(max_waiting=2)
    one = queue.join("a", "j1")
    queue.join("b", "j2")
    with pytest.raises(QueueFullError) as full:
        queue.join("a", "j3")
    assert full.value.code == "queue_full"
    queue.leave(one)
    assert queue.join("a", "j3").position == 1
    with pytest.raises(ValueError):
        AdmissionQueue(max_waiting=0)
