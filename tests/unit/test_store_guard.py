"""The store's circuit breaker: outages trip it, commands then fail fast, a probe closes it."""

from __future__ import annotations

import threading

import pytest
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import OperationalError

from application.controller import Controller
from application.store_guard import StoreGuard, StoreUnavailable
from domain.errors import IllegalTransition
from tests.unit.job_cluster import GUARD


class ScriptedProbe:
    """Answers False until told to answer True; records what ran in which order."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.calls: list[str] = []

    def __call__(self) -> bool:
        self.calls.append("probe")
        return self.answer.is_set()


def test_only_outages_trip_it_and_a_probe_closes_it() -> None:
    probe = ScriptedProbe()
    back = threading.Event()

    def on_back() -> None:
        probe.calls.append("on_back")
        back.set()

    guard = StoreGuard(probe, on_back=on_back, probe_interval=0.001)
    try:
        guard.observe(IllegalTransition("job", "complete", "QUEUED"))  # the store works
        guard.observe(ValueError("not about the store"))
        guard.check()
        assert guard.up and guard.trips == 0

        guard.observe(OperationalError("server closed the connection unexpectedly"))
        guard.observe(OperationalError("again: the same outage"))
        assert not guard.up and guard.trips == 1
        with pytest.raises(StoreUnavailable, match="server closed the connection"):
            guard.check()

        probe.answer.set()
        assert back.wait(GUARD)
        while not guard.up:  # on_back runs before the guard lets commands through
            pass
        guard.check()
        assert probe.calls[-2:] == ["probe", "on_back"]
    finally:
        guard.close()


def test_a_failing_on_back_keeps_it_open_until_reconnecting_works() -> None:
    attempts: list[int] = []
    done = threading.Event()

    def reconnect() -> None:
        attempts.append(1)
        if len(attempts) < 3:
            raise OperationalError("pool not ready")
        done.set()

    guard = StoreGuard(lambda: True, on_back=reconnect, probe_interval=0.001)
    try:
        guard.observe(ConnectionError("refused"))
        assert done.wait(GUARD)
        while not guard.up:
            pass
        assert len(attempts) == 3
    finally:
        guard.close()


def test_commands_fail_fast_while_the_store_is_unreachable() -> None:
    app = Controller(guard=StoreGuard(lambda: False, probe_interval=60))
    try:
        app.guard.observe(OperationalError("terminating connection due to administrator command"))
        ran: list[str] = []

        def command() -> list[Aggregate]:
            ran.append("command")
            return []

        with pytest.raises(StoreUnavailable):
            app.aggregates.run(command)
        assert ran == []  # not even loaded: no pool wait
    finally:
        app.guard.close()
