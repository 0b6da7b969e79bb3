"""Admin model registry: ``POST/GET /api/admin/models``."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller as Routes
from litestar import get, post
from litestar.datastructures import State
from litestar.params import JSONBody

from domain.model import (
    DEFAULT_CONTEXT_SIZE,
    EMBEDDING,
    FILE_NAME_PATTERN,
    MAX_CONTEXT_SIZE,
    MIN_CONTEXT_SIZE,
    MODEL_NAME_PATTERN,
    SHA256_PATTERN,
)
from interfaces.admin_api import READ_YOUR_WRITES_TIMEOUT, services
from interfaces.http_auth import admin_guard
from interfaces.http_docs import (
    ADMIN_KEY_ERRORS,
    ApiOperation,
    RegisteredModelRow,
    RegisteredModels,
    errors,
    success,
)
from interfaces.http_errors import ApiError
from interfaces.openai_fields import INVALID_COMBINATION


class ModelRegistration(msgspec.Struct):
    """The domain's rules (:func:`domain.model.validate_model`), documented and checked as
    the body is read; the domain checks them again."""

    name: Annotated[str, msgspec.Meta(pattern=MODEL_NAME_PATTERN)]
    sha256: Annotated[str, msgspec.Meta(pattern=SHA256_PATTERN)]
    file_name: Annotated[str, msgspec.Meta(pattern=FILE_NAME_PATTERN)]
    context_size: Annotated[int, msgspec.Meta(ge=MIN_CONTEXT_SIZE, le=MAX_CONTEXT_SIZE)] = (
        DEFAULT_CONTEXT_SIZE
    )
    #: "chat" (chat and legacy completions) or "embedding" (``/v1/embeddings``).
    kind: Literal["chat", "embedding"] = "chat"
    #: An embedding model's pooling ("": the model's own).
    pooling: Literal["", "mean", "cls", "last"] = ""


class AdminModelRoutes(Routes):
    path = "/api/admin/models"
    guards = [admin_guard]
    tags = ["admin"]
    security = [{"BearerAuth": []}]

    @post(
        "/",
        status_code=201,
        summary="Register a model (API name → GGUF file by sha256)",
        operation_class=ApiOperation,
        responses={
            **success(RegisteredModelRow, "The model as registered", 201),
            **errors(400, *ADMIN_KEY_ERRORS, 503),
        },
    )
    async def register(self, state: State, data: JSONBody[ModelRegistration]) -> dict[str, Any]:
        if data.pooling and data.kind != EMBEDDING:
            raise ApiError(
                400,
                "pooling is for embedding models only",
                param="pooling",
                code=INVALID_COMBINATION,
            )
        svc = services(state)
        result = await asyncio.to_thread(
            svc.app.register_model,
            data.name,
            data.sha256,
            data.file_name,
            data.context_size,
            data.kind,
            data.pooling,
        )
        await asyncio.to_thread(svc.follower.wait, result.position, READ_YOUR_WRITES_TIMEOUT)
        row = await asyncio.to_thread(svc.read_model.get_model, data.name)
        assert row is not None
        return row

    @get(
        "/",
        summary="Registered models",
        operation_class=ApiOperation,
        responses={
            **success(RegisteredModels, "Every registered model, by name"),
            **errors(*ADMIN_KEY_ERRORS, 503),
        },
    )
    async def list_models(self, state: State) -> dict[str, Any]:
        rows = await asyncio.to_thread(services(state).read_model.list_models)
        return {"object": "list", "data": rows}
