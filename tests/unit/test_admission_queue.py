"""AdmissionQueue bookkeeping: FIFO per model, only the head is woken, bounded size, and the
bounded exceptions the caches may make."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from application.admission import (
    MAX_PASSES,
    REORDER_WINDOW,
    AdmissionQueue,
    QueueFullError,
    Ticket,
    may_pass,
)


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


def test_a_later_request_may_go_first_within_the_window_and_the_passes() -> None:
    queue = AdmissionQueue()
    tickets = [queue.join("m", f"j{i}", chain=(i,)) for i in range(REORDER_WINDOW + 3)]
    head = tickets[0]
    assert queue.overtakers(head) == tickets[1 : REORDER_WINDOW + 1]
    assert queue.overtakers(tickets[1]) == []  # only the head is asked
    chosen = tickets[3]
    chosen.wakeup.clear()
    queue.promote(chosen)
    assert queue.is_head(chosen) and chosen.wakeup.is_set()
    assert [t.passes for t in tickets[:4]] == [1, 1, 1, 0]  # those it went before
    queue.promote(chosen)  # already the head: nothing changes
    assert [t.passes for t in tickets[:4]] == [1, 1, 1, 0]
    # a request that let MAX_PASSES go first lets nobody behind it go first again
    tickets[1].passes = MAX_PASSES
    queue.leave(chosen)
    assert queue.overtakers(head) == [tickets[1]]
    with pytest.raises(ValueError, match="bound"):
        queue.promote(tickets[2])


def test_a_request_counts_one_pass_per_capacity_change() -> None:
    queue = AdmissionQueue()
    head = queue.join("m", "j1", chain=(1,))
    queue.passed([head])
    queue.passed([head])  # asked again (a new arrival) before any slot came free: one pass
    assert head.passes == 1
    queue.wake()
    queue.passed([head])
    assert head.passes == 2 and may_pass(head)
    head.passes = MAX_PASSES
    assert not may_pass(head)


def test_a_routed_arrival_wakes_the_head_an_unrouted_one_does_not() -> None:
    """A free slot may wait for the conversation that just arrived (its chain)."""
    queue = AdmissionQueue()
    head = queue.join("m", "j1")
    head.wakeup.clear()
    queue.join("m", "j2")
    assert not head.wakeup.is_set()
    queue.join("m", "j3", chain=(7,))
    assert head.wakeup.is_set()


@given(steps=st.lists(st.tuples(st.sampled_from("jpgw"), st.integers(0, 40)), max_size=300))
def test_no_request_is_passed_more_than_the_bound(steps: list[tuple[str, int]]) -> None:
    """Whatever the caches decide (which request goes, who lets a free slot go by), every
    request is gone before by at most MAX_PASSES later requests plus free slots it let go."""
    queue = AdmissionQueue(max_waiting=1000)
    waiting: list[Ticket] = []
    overtaken: dict[str, int] = {}  # counted here, independently of the queue
    joined = 0
    for op, pick in steps:
        if op == "j":
            waiting.append(queue.join("m", f"j{joined}", chain=(joined,)))
            overtaken[f"j{joined}"] = 0
            joined += 1
        elif waiting and op == "g":  # one goes: the head or one the queue lets go first
            head = next(t for t in waiting if queue.is_head(t))
            allowed = [head, *queue.overtakers(head)]
            chosen = allowed[pick % len(allowed)]
            for ahead in waiting[: waiting.index(chosen)]:
                overtaken[ahead.job_id] += 1
            queue.promote(chosen)
            queue.leave(chosen)
            waiting.remove(chosen)
        elif waiting and op == "p":  # some let the free slot go by
            head = next(t for t in waiting if queue.is_head(t))
            looked_at = [head, *queue.overtakers(head)]
            queue.passed([t for t in looked_at[: pick % len(looked_at) + 1] if may_pass(t)])
        elif op == "w":
            queue.wake("m")
        for ticket in waiting:
            assert ticket.passes <= MAX_PASSES
            assert overtaken[ticket.job_id] <= ticket.passes
