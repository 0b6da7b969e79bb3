"""Fixtures of the agent tests: a fake controller (:mod:`tests.integration.fake_control_plane`)
serving on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.fake_control_plane import FakeControlPlane, start_server


@pytest.fixture
def fake() -> FakeControlPlane:
    return FakeControlPlane()


@pytest.fixture
async def controller_url(fake: FakeControlPlane) -> AsyncIterator[str]:
    server, port = await start_server(fake)
    yield f"127.0.0.1:{port}"
    await server.stop(None)
