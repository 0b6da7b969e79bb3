"""Device budgets lowered after an out-of-memory (application/device_budgets.py): pure
bookkeeping on a fake clock."""

from __future__ import annotations

import pytest

from application.device_budgets import (
    LOWERED_FRACTION,
    MIN_BUDGET_BYTES,
    DeviceBudgets,
)

MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_device_that_ran_out_gets_a_fraction_of_what_the_plan_gave_it() -> None:
    clock = FakeClock()
    budgets = DeviceBudgets(seconds=60, clock=clock)
    assert budgets.cap("n1", "CUDA0") is None
    lowered = budgets.lower("n1", "CUDA0", planned_bytes=800 * MIB, asked_bytes=900 * MIB)
    assert lowered.budget_bytes == int(800 * MIB * LOWERED_FRACTION)
    assert budgets.cap("n1", "CUDA0") == lowered.budget_bytes
    # Other devices of the node, and the same name on another node, are untouched.
    assert budgets.cap("n1", "CUDA1") is None
    assert budgets.cap("n2", "CUDA0") is None


def test_another_out_of_memory_lowers_it_further_and_never_below_the_floor() -> None:
    budgets = DeviceBudgets(seconds=60, clock=FakeClock())
    budgets.lower("n1", "CPU", planned_bytes=100 * MIB)
    first = budgets.cap("n1", "CPU")
    assert first is not None
    # A later plan that gave it more than its budget cannot raise it.
    budgets.lower("n1", "CPU", planned_bytes=400 * MIB)
    second = budgets.cap("n1", "CPU")
    assert second is not None and second < first
    for _ in range(40):
        budgets.lower("n1", "CPU", planned_bytes=1)
    assert budgets.cap("n1", "CPU") == MIN_BUDGET_BYTES


def test_the_asked_bytes_count_when_the_plan_gave_the_device_nothing_it_knew_of() -> None:
    budgets = DeviceBudgets(seconds=60, clock=FakeClock())
    budgets.lower("n1", "CUDA0", planned_bytes=0, asked_bytes=200 * MIB)
    assert budgets.cap("n1", "CUDA0") == int(200 * MIB * LOWERED_FRACTION)


def test_a_lowered_budget_lapses_after_its_time() -> None:
    clock = FakeClock()
    budgets = DeviceBudgets(seconds=60, clock=clock)
    budgets.lower("n1", "CUDA0", planned_bytes=800 * MIB)
    version = budgets.version
    clock.now += 59.9
    assert budgets.cap("n1", "CUDA0") is not None
    assert [b.device for b in budgets.active()] == ["CUDA0"]
    clock.now += 0.1
    assert budgets.cap("n1", "CUDA0") is None
    assert budgets.active() == []
    assert budgets.version > version  # what was derived from the budget is stale now


def test_a_budget_must_hold_for_a_positive_time() -> None:
    with pytest.raises(ValueError, match="positive"):
        DeviceBudgets(seconds=0)
