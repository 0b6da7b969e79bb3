"""``ctl`` fixtures made to order: a test module names what its controller's settings differ in
(and whether it runs on the test's private PostgreSQL cluster or Redis server) instead of
writing the same start-and-stop fixture again."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Literal

import pytest

from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.faults.services import OwnPostgres, OwnRedis


def controller_fixture(
    *, own: Literal["postgres", "redis"] | None = None, **overrides: object
) -> Callable[..., object]:
    """A function-scoped fixture named ``ctl``: a controller with
    ``controller_settings(**overrides)``, on the ``own_postgres`` cluster or the ``own_redis``
    server when ``own`` says so (the same ones the test gets when it asks for them too)."""

    async def ctl(
        pg_schema: str, tmp_path: Path, request: pytest.FixtureRequest
    ) -> AsyncIterator[RunningController]:
        settings = dict(overrides)
        if own == "postgres":
            server: OwnPostgres = request.getfixturevalue("own_postgres")
            settings["database_url"] = f"{server.url}?schema={pg_schema}"
        elif own == "redis":
            cache: OwnRedis = request.getfixturevalue("own_redis")
            settings["redis_url"] = cache.url
        async with controller(controller_settings(pg_schema, tmp_path, **settings)) as running:
            yield running

    return pytest.fixture(ctl)
