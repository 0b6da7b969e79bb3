"""The admin API's 404 for an unknown model, node or enrollment token names the closest known
ones (what ``dacp models source|pull|evict`` and ``dacp token revoke`` print), against a real
controller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings

pytestmark = pytest.mark.timeout(60)

ADMIN = {"Authorization": "Bearer test-admin-key"}


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    async with controller(controller_settings(pg_schema, tmp_path)) as running:
        yield running


async def test_an_unknown_model_or_node_gets_the_closest_known(ctl: RunningController) -> None:
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{ctl.http_port}", headers=ADMIN, timeout=30
    ) as client:
        for name in ("tiny-model", "tiny-embedder"):
            model = {"name": name, "sha256": "cd" * 32, "file_name": f"{name}.gguf"}
            r = await client.post("/api/admin/models", json=model)
            assert r.status_code == 201, r.text
        source = {"model": "tiny-modle", "url": "https://example.com/tiny.gguf"}
        r = await client.post("/api/admin/models/sources", json=source)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found"
        assert error["message"] == "no model named tiny-modle; closest known: tiny-model"

        r = await client.post(
            "/api/admin/models/pull", json={"model": "tiny-model", "nodes": ["gpu"]}
        )
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert (error["code"], error["message"]) == (
            "node_not_found",
            "no node named gpu; no node is known yet",
        )


async def test_an_unknown_token_gets_the_closest_known(ctl: RunningController) -> None:
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{ctl.http_port}", headers=ADMIN, timeout=30
    ) as client:
        r = await client.post("/api/admin/enrollment-tokens", json={})
        assert r.status_code == 201, r.text
        token_id = r.json()["token_id"]
        typo = token_id[:-1] + ("0" if token_id[-1] != "0" else "1")
        r = await client.post(f"/api/admin/enrollment-tokens/{typo}/revoke")
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "token_not_found"
        assert error["message"] == f"unknown enrollment token {typo!r}; closest known: {token_id}"
