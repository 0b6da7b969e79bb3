"""Fixtures of the fault suite: private Redis servers (tests/faults/services; the private
PostgreSQL, ``own_postgres``, is in tests/conftest.py: a security test stops it too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.services import OwnRedis


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path / "redis").start()
    yield server
    server.stop()
