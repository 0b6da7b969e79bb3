"""Fixtures of the fault suite: private PostgreSQL and Redis servers (tests/faults/services)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.services import OwnPostgres, OwnRedis


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    server = OwnPostgres().init().start()
    yield server
    server.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path / "redis").start()
    yield server
    server.stop()
