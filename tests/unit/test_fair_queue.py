"""The admission queue's fair order (application/admission.py, application/fair_order.py): API
keys take turns within a priority class, FIFO within a key, interactive before batch with one
batch request after every INTERACTIVE_WEIGHT interactive ones, queue positions that match the
order, FIFO when fairness is off, and the cache-aware exception's bound in the fair order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from application.admission import MAX_PASSES, REORDER_WINDOW, AdmissionQueue, Ticket, may_pass
from application.fair_order import INTERACTIVE_WEIGHT
from domain.api_keys import Grant, Priority

A = Grant("a", "team a")
B = Grant("b", "team b")
C = Grant("c", "team c")
BATCH = Grant("x", "nightly batch", priority=Priority.BATCH)
BATCH_Y = Grant("y", "other batch", priority=Priority.BATCH)


def head(queue: AdmissionQueue, waiting: list[Ticket]) -> Ticket:
    return next(t for t in waiting if queue.is_head(t))


def drain(queue: AdmissionQueue, waiting: list[Ticket]) -> list[str]:
    """Dispatches the head until nobody waits; the job ids in dispatch order."""
    left = list(waiting)
    served = []
    while left:
        first = head(queue, left)
        queue.dispatched(first)
        left.remove(first)
        served.append(first.job_id)
    assert len(queue) == 0
    return served


def test_a_key_with_many_waiting_delays_another_key_by_one_dispatch() -> None:
    queue = AdmissionQueue()
    flood = [queue.join("m", f"a{i}", grant=A) for i in range(500)]
    late = queue.join("m", "b0", grant=B)
    assert late.position == 2  # a0 was the head already; then b0
    queue.dispatched(flood[0])
    assert queue.is_head(late) and late.wakeup.is_set()
    queue.dispatched(late)
    assert queue.is_head(flood[1])
    # a key served in this round that comes back waits for the next round: b1 goes after a1
    again = queue.join("m", "b1", grant=B)
    assert again.position == 2
    queue.dispatched(flood[1])
    assert queue.is_head(again)


def test_a_newcomer_goes_before_the_key_that_was_just_served() -> None:
    """The flood's running request had its turn: a newcomer's request is next, not after one
    more of the flood's (a round serves each waiting key once)."""
    queue = AdmissionQueue()
    flood = [queue.join("m", f"a{i}", grant=A) for i in range(5)]
    queue.dispatched(flood[0])  # a0 runs
    late = queue.join("m", "b0", grant=B)
    assert late.position == 1 and queue.is_head(late) and late.wakeup.is_set()


def test_keys_take_turns_and_each_key_is_first_in_first_out() -> None:
    queue = AdmissionQueue()
    waiting = [queue.join("m", f"a{i}", grant=A) for i in range(3)]
    waiting += [queue.join("m", f"b{i}", grant=B) for i in range(2)]
    waiting += [queue.join("m", "c0", grant=C)]
    assert [t.position for t in waiting] == [1, 2, 3, 2, 4, 3]  # as the queue stood
    assert [queue.position(t) for t in waiting] == [1, 4, 6, 2, 5, 3]
    assert drain(queue, waiting) == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_interactive_goes_first_and_batch_every_weight_plus_one() -> None:
    queue = AdmissionQueue()
    batch = [queue.join("m", f"x{i}", grant=BATCH) for i in range(2)]
    interactive = [queue.join("m", f"a{i}", grant=A) for i in range(2 * INTERACTIVE_WEIGHT + 1)]
    served = drain(queue, batch + interactive)
    w = INTERACTIVE_WEIGHT
    expected = [f"a{i}" for i in range(w)] + ["x0"] + [f"a{i}" for i in range(w, 2 * w)]
    assert served == [*expected, "x1", f"a{2 * w}"]


def test_an_interactive_arrival_becomes_the_head_before_a_waiting_batch_request() -> None:
    queue = AdmissionQueue()
    batch = queue.join("m", "x0", grant=BATCH)
    assert queue.is_head(batch)
    urgent = queue.join("m", "a0", grant=A)
    assert urgent.position == 1 and queue.is_head(urgent) and urgent.wakeup.is_set()
    assert queue.position(batch) == 2
    # the batch head was placed meanwhile (it was trying): batch's turn is used all the same
    queue.dispatched(batch)
    assert queue.is_head(urgent) and len(queue) == 1


def test_a_request_that_leaves_unserved_does_not_use_its_keys_turn() -> None:
    queue = AdmissionQueue()
    a0, a1 = queue.join("m", "a0", grant=A), queue.join("m", "a1", grant=A)
    b0 = queue.join("m", "b0", grant=B)
    queue.leave(a0)  # timed out: a's turn in this round is still a's
    assert queue.is_head(a1) and a1.wakeup.is_set()
    assert queue.position(b0) == 2
    queue.leave(b0)
    queue.leave(b0)  # idempotent
    queue.dispatched(b0)  # gone already: nothing happens
    assert len(queue) == 1 and queue.depth("m") == 1
    with pytest.raises(ValueError, match="does not wait"):
        queue.position(b0)


def test_models_queue_apart() -> None:
    queue = AdmissionQueue()
    a = queue.join("m", "a0", grant=A)
    other = queue.join("n", "b0", grant=B)
    assert queue.is_head(a) and queue.is_head(other) and other.position == 1
    assert queue.depths() == {"m": 1, "n": 1}


def test_fairness_off_is_first_in_first_out() -> None:
    queue = AdmissionQueue(fair=False)
    waiting = [queue.join("m", f"x{i}", grant=BATCH) for i in range(2)]
    waiting += [queue.join("m", f"a{i}", grant=A) for i in range(3)]
    waiting += [queue.join("m", "b0", grant=B)]
    assert [t.position for t in waiting] == [1, 2, 3, 4, 5, 6]
    assert drain(queue, waiting) == ["x0", "x1", "a0", "a1", "a2", "b0"]


def test_later_requests_go_first_within_the_window_of_the_fair_order() -> None:
    queue = AdmissionQueue()
    flood = [queue.join("m", f"a{i}", chain=(i,), grant=A) for i in range(REORDER_WINDOW + 5)]
    late = queue.join("m", "b0", chain=(99,), grant=B)
    first = flood[0]
    behind = queue.overtakers(first)
    assert behind[0] is late  # second in the fair order, though it came last
    assert behind == [late, *flood[1:REORDER_WINDOW]]
    chosen = flood[3]
    queue.promote(chosen)
    assert queue.is_head(chosen) and chosen.wakeup.is_set()
    # passed: those before it in the fair order (a0, b0, a1, a2), not in arrival order
    assert [first.passes, late.passes, flood[1].passes, flood[2].passes] == [1, 1, 1, 1]
    assert flood[4].passes == 0
    queue.dispatched(chosen)  # out of turn: a's turn in the round is not used
    assert queue.is_head(first)
    queue.dispatched(first)
    assert queue.is_head(late)


@dataclass
class Model:
    """The test's own account of what happened, independent of the queue's. Tickets are known
    by their job ids: the ``id()`` of a ticket that left may be a new ticket's."""

    waiting: list[Ticket] = field(default_factory=list)  # in arrival order
    went_first: set[str] = field(default_factory=set)  # job ids of promoted tickets
    log: list[Ticket] = field(default_factory=list)  # in-turn dispatches
    #: For each waiting ticket: how many in-turn dispatches were logged when it became the
    #: oldest waiting request of its key.
    head_at: dict[str, int] = field(default_factory=dict)
    #: For each ticket: the requests that went first before it.
    overtaken: dict[str, int] = field(default_factory=dict)
    #: Interactive dispatches since the last batch one, or since batch requests wait.
    streak: int = 0

    def oldest_of_key(self, ticket: Ticket) -> bool:
        return next(t for t in self.waiting if t.key == ticket.key) is ticket

    def batch_waits(self) -> bool:
        return any(
            t.priority == Priority.BATCH and t.job_id not in self.went_first for t in self.waiting
        )

    def note_heads(self) -> None:
        for t in self.waiting:
            if t.job_id not in self.head_at and self.oldest_of_key(t):
                self.head_at[t.job_id] = len(self.log)

    def gone(self, ticket: Ticket) -> None:
        self.waiting.remove(ticket)
        self.went_first.discard(ticket.job_id)
        self.note_heads()


OPS = st.lists(
    st.tuples(st.sampled_from("jjjjdddlpw"), st.integers(0, 5), st.integers(0, 40)),
    max_size=250,
)
GRANTS = [A, B, C, Grant("d", "team d"), BATCH, BATCH_Y]


@settings(max_examples=300, deadline=None)
@given(steps=OPS)
def test_the_fairness_bound_fifo_within_a_key_and_no_batch_starvation(
    steps: list[tuple[str, int, int]],
) -> None:
    """For any arrivals, departures and cache exceptions: from the moment a request is the
    oldest of its key until it is dispatched, every other key of its class is dispatched in
    turn at most once (requests that went first, out of turn, are bounded by MAX_PASSES, as
    ever); batch goes after at most INTERACTIVE_WEIGHT interactive dispatches in a row;
    in-turn dispatches keep FIFO within a key; positions are where the order serves."""
    queue = AdmissionQueue(max_waiting=1000)
    model = Model()
    for n, (op, which, pick) in enumerate(steps):
        if op == "j":
            grant = GRANTS[which]
            if grant.priority == Priority.BATCH and not model.batch_waits():
                model.streak = 0
            model.waiting.append(queue.join("m", f"j{n}", chain=(n,), grant=grant))
            model.note_heads()
        elif op == "d" and model.waiting:
            first = head(queue, model.waiting)
            if first.job_id not in model.went_first:
                assert model.oldest_of_key(first)  # FIFO within a key
                since = model.log[model.head_at[first.job_id] :]
                others = [t for t in since if t.priority == first.priority]
                keys = [t.key for t in others]
                assert all(keys.count(key) <= 1 for key in keys), keys
                assert first.key not in keys
                classes = [t.priority for t in since]
                interactive = classes.count(Priority.INTERACTIVE)
                batch = classes.count(Priority.BATCH)
                if first.priority == Priority.INTERACTIVE:
                    assert batch <= interactive // INTERACTIVE_WEIGHT + 1
                    if model.batch_waits():
                        model.streak += 1
                        assert model.streak <= INTERACTIVE_WEIGHT
                else:
                    assert interactive <= INTERACTIVE_WEIGHT * (batch + 1)
                    model.streak = 0
                model.log.append(first)
            queue.dispatched(first)
            model.gone(first)
        elif op == "l" and model.waiting:
            left = model.waiting[pick % len(model.waiting)]
            queue.leave(left)
            model.gone(left)
        elif op == "p" and model.waiting:
            first = head(queue, model.waiting)
            allowed = queue.overtakers(first)
            if allowed:
                chosen = allowed[pick % len(allowed)]
                place = queue.position(chosen)
                for t in model.waiting:
                    if queue.position(t) < place:
                        model.overtaken[t.job_id] = model.overtaken.get(t.job_id, 0) + 1
                queue.promote(chosen)
                model.went_first.add(chosen.job_id)
        elif op == "w":
            queue.wake("m")
        for t in model.waiting:
            assert model.overtaken.get(t.job_id, 0) <= t.passes <= MAX_PASSES
    positions = {t.job_id: queue.position(t) for t in model.waiting}
    served = drain(queue, model.waiting)
    assert [positions[job] for job in served] == list(range(1, len(served) + 1))


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=120),
    fair=st.booleans(),
)
def test_the_position_at_joining_is_where_the_order_serves_it_if_nobody_else_comes(
    arrivals: list[tuple[int, bool]], fair: bool
) -> None:
    """Requests join (some dispatched between arrivals); the last one's reported position is
    its place in the dispatches that follow."""
    queue = AdmissionQueue(fair=fair)
    waiting: list[Ticket] = []
    for n, (which, dispatch_first) in enumerate(arrivals):
        if dispatch_first and waiting:
            first = head(queue, waiting)
            queue.dispatched(first)
            waiting.remove(first)
        waiting.append(queue.join("m", f"j{n}", grant=GRANTS[which]))
    last = waiting[-1]
    assert drain(queue, waiting).index(last.job_id) + 1 == last.position
    if not fair:
        assert last.position == len(waiting)


def test_the_overtakers_stop_at_a_request_that_may_pass_no_more() -> None:
    queue = AdmissionQueue()
    first = queue.join("m", "a0", chain=(1,), grant=A)
    second = queue.join("m", "b0", chain=(2,), grant=B)
    third = queue.join("m", "a1", chain=(3,), grant=A)
    second.passes = MAX_PASSES
    assert not may_pass(second)
    assert queue.overtakers(first) == [second]
    assert queue.overtakers(third) == []  # not the head
