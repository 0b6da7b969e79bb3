"""Admin model registry: ``POST/GET /api/admin/models``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from litestar import Controller as Routes
from litestar import get, post
from litestar.datastructures import State
from litestar.params import JSONBody

from domain.model import DEFAULT_CONTEXT_SIZE
from interfaces.admin_api import READ_YOUR_WRITES_TIMEOUT, services
from interfaces.http_auth import admin_guard


@dataclass
class ModelRegistration:
    name: str
    sha256: str
    file_name: str
    context_size: int = DEFAULT_CONTEXT_SIZE


class AdminModelRoutes(Routes):
    path = "/api/admin/models"
    guards = [admin_guard]
    tags = ["admin"]
    security = [{"BearerAuth": []}]

    @post("/", status_code=201, summary="Register a model (API name → GGUF file by sha256)")
    async def register(self, state: State, data: JSONBody[ModelRegistration]) -> dict[str, Any]:
        svc = services(state)
        result = await asyncio.to_thread(
            svc.app.register_model, data.name, data.sha256, data.file_name, data.context_size
        )
        await asyncio.to_thread(svc.follower.wait, result.position, READ_YOUR_WRITES_TIMEOUT)
        row = await asyncio.to_thread(svc.read_model.get_model, data.name)
        assert row is not None
        return row

    @get("/", summary="Registered models")
    async def list_models(self, state: State) -> dict[str, Any]:
        rows = await asyncio.to_thread(services(state).read_model.list_models)
        return {"object": "list", "data": rows}
