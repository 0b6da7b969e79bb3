"""The decision runner: quick decisions on the event loop, slow ones in their thread."""

from __future__ import annotations

import threading

from application.decision_runner import INLINE_DECISION_SECONDS, LATEST_WEIGHT, DecisionRunner


class FakeClock:
    """A clock each decision advances by the time it is told to take."""

    def __init__(self) -> None:
        self.now = 0.0
        self.takes = 0.0

    def __call__(self) -> float:
        return self.now

    def decide(self, value: int) -> tuple[int, str]:
        self.now += self.takes
        return value, threading.current_thread().name


async def test_quick_decisions_run_on_the_event_loop() -> None:
    clock = FakeClock()
    runner = DecisionRunner(clock)
    clock.takes = INLINE_DECISION_SECONDS / 10
    for value in range(5):
        assert await runner.run(clock.decide, value) == (value, threading.current_thread().name)
    assert runner.inline


async def test_slow_decisions_go_to_their_thread_and_come_back_once_quick() -> None:
    clock = FakeClock()
    runner = DecisionRunner(clock)
    clock.takes = 0.003  # a thousand nodes
    value, where = await runner.run(clock.decide, 1)  # the first runs inline: nothing known
    assert (value, where) == (1, threading.current_thread().name)
    assert runner.average == 0.003 * LATEST_WEIGHT
    assert not runner.inline
    value, where = await runner.run(clock.decide, 2)
    assert value == 2 and where.startswith("placement")
    clock.takes = 0.0001
    while not runner.inline:
        await runner.run(clock.decide, 3)
    assert await runner.run(clock.decide, 4) == (4, threading.current_thread().name)


async def test_one_slow_decision_among_quick_ones_moves_the_average_a_fifth() -> None:
    clock = FakeClock()
    runner = DecisionRunner(clock)
    clock.takes = 0.0002
    for _ in range(20):
        await runner.run(clock.decide, 0)
    before = runner.average
    clock.takes = 0.0012
    await runner.run(clock.decide, 0)
    assert abs(runner.average - (before + (0.0012 - before) * LATEST_WEIGHT)) < 1e-12
