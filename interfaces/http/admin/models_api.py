"""Admin model registry: ``POST/GET /api/admin/models``."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import msgspec
from litestar import get, post
from litestar.params import JSONBody

from application.close_names import suggestion
from application.model_claims import ModelClaims
from application.model_transfers import TransferCoordinator, TransferRefused
from application.read_models import proven_holders
from common.model_sources import SourceRefused, check_url, parse_cidrs
from domain.model import (
    DEFAULT_CONTEXT_SIZE,
    EMBEDDING,
    FILE_NAME_PATTERN,
    MAX_CONTEXT_SIZE,
    MAX_URL_CHARS,
    MIN_CONTEXT_SIZE,
    MODEL_NAME_PATTERN,
    SHA256_PATTERN,
    SOURCE_URL_PATTERN,
)
from domain.model_claims import STORE
from domain.states import NodeState
from interfaces.http.admin.admin_api import READ_YOUR_WRITES_TIMEOUT
from interfaces.http.admin.admin_routes import AdminController
from interfaces.http.http_docs import (
    ADMIN_KEY_ERRORS,
    ApiOperation,
    ModelEvictionRow,
    ModelPulls,
    RegisteredModelRow,
    RegisteredModels,
    errors,
    success,
)
from interfaces.http.http_errors import ApiError, ErrorCode, not_running
from interfaces.services import Provided, Services

#: The error code of a model source on a refused address.
SOURCE_REFUSED = ErrorCode.SOURCE_REFUSED


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


class ModelPull(msgspec.Struct):
    """Which model to fetch onto which nodes (names or ids)."""

    model: Annotated[str, msgspec.Meta(pattern=MODEL_NAME_PATTERN)]
    #: Names or ids; one that no node has is answered 404.
    nodes: Annotated[list[str], msgspec.Meta(min_length=1, max_length=256)]


#: Node states in which a node counts as holding what it proved it holds.
_HOLDING = frozenset(s.value for s in NodeState if s != NodeState.OFFLINE)


async def _with_holders(svc: Services, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model rows with the names of the nodes that proved they hold each file
    (``held_by``: neither revoked nor offline; a node's report alone is not enough)."""
    nodes = await asyncio.to_thread(svc.read_model.list_nodes)
    by_id = {n["node_id"]: n for n in nodes}
    return [
        {
            **row,
            "held_by": sorted(n["name"] for n in proven_holders(row, by_id, _HOLDING)),
            "stored": row.get("stored"),
            # Rows projected before facts had a basis: the store's, if any.
            "shape": row.get("shape") or row.get("stored"),
            "shape_from": row.get("shape_from") or (STORE if row.get("stored") else None),
        }
        for row in rows
    ]


class ModelSource(msgspec.Struct):
    """An http(s) URL of a registered model's file."""

    model: Annotated[str, msgspec.Meta(pattern=MODEL_NAME_PATTERN)]
    url: Annotated[str, msgspec.Meta(pattern=SOURCE_URL_PATTERN, max_length=MAX_URL_CHARS)]


async def _check_source(allowed_cidrs: tuple[str, ...], url: str) -> None:
    """400 ``source_refused`` for a URL nodes would refuse to fetch from (resolved here)."""
    try:
        await asyncio.to_thread(check_url, url, parse_cidrs(allowed_cidrs))
    except SourceRefused as e:
        raise ApiError(400, str(e), param="url", code=SOURCE_REFUSED) from e


class ModelEviction(msgspec.Struct):
    """Which model to delete from which node's disk (a name or id)."""

    model: Annotated[str, msgspec.Meta(pattern=MODEL_NAME_PATTERN)]
    node: str


async def _no_model(svc: Services, name: str) -> ApiError:
    """404 for the unknown model ``name``, naming the closest registered ones."""
    names = [str(m["name"]) for m in await asyncio.to_thread(svc.read_model.list_models)]
    return ApiError(
        404,
        f"no model named {name}{suggestion('model', name, names)}",
        code=ErrorCode.MODEL_NOT_FOUND,
    )


async def _transfer_targets(
    svc: Services,
    transfers: TransferCoordinator | None,
    name: str,
    refs: list[str],
    param: str,
) -> tuple[TransferCoordinator, dict[str, Any], list[str]]:
    """The transfer coordinator, the model named ``name`` and the ids of the nodes ``refs``
    name (names or ids); 404 for an unknown one."""
    if transfers is None:
        raise not_running("the transfer coordinator is not running")
    model = await asyncio.to_thread(svc.read_model.get_model, name)
    if model is None:
        raise await _no_model(svc, name)
    nodes = await asyncio.to_thread(svc.read_model.list_nodes)
    ids = []
    for ref in refs:
        match = [n for n in nodes if ref in (n["node_id"], n["name"])]
        if not match:
            hint = suggestion("node", ref, [str(n["name"]) for n in nodes])
            raise ApiError(
                404, f"no node named {ref}{hint}", param=param, code=ErrorCode.NODE_NOT_FOUND
            )
        ids.append(match[0]["node_id"])
    return transfers, model, ids


class AdminModelRoutes(AdminController):
    path = "/api/admin/models"

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
    async def register(
        self,
        svc: Provided[Services],
        claims: Provided[ModelClaims | None],
        data: JSONBody[ModelRegistration],
    ) -> dict[str, Any]:
        if data.pooling and data.kind != EMBEDDING:
            raise ApiError(
                400,
                "pooling is for embedding models only",
                param="pooling",
                code=ErrorCode.INVALID_COMBINATION,
            )
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
        if claims is not None:  # the nodes that report the file prove it first (held_by)
            await claims.settled(row, READ_YOUR_WRITES_TIMEOUT)
            row = await asyncio.to_thread(svc.read_model.get_model, data.name)
            assert row is not None
        return (await _with_holders(svc, [row]))[0]

    @get(
        "/",
        summary="Registered models",
        operation_class=ApiOperation,
        responses={
            **success(RegisteredModels, "Every registered model, by name"),
            **errors(*ADMIN_KEY_ERRORS, 503),
        },
    )
    async def list_models(self, svc: Provided[Services]) -> dict[str, Any]:
        rows = await asyncio.to_thread(svc.read_model.list_models)
        return {"object": "list", "data": await _with_holders(svc, rows)}

    @post(
        "/pull",
        status_code=202,
        summary="Fetch a model onto nodes from nodes that hold it (transfers run in the "
        "background: MODEL_TRANSFER_* events)",
        operation_class=ApiOperation,
        responses={
            **success(ModelPulls, "The transfers asked for (none for nodes that hold it)", 202),
            **errors(
                400,
                *ADMIN_KEY_ERRORS,
                (404, "Unknown model or node (`model_not_found`, `node_not_found`)"),
                (409, "No node can serve the model, or a node is not connected (`no_source`)"),
                503,
            ),
        },
    )
    async def pull(
        self,
        svc: Provided[Services],
        transfers: Provided[TransferCoordinator | None],
        data: JSONBody[ModelPull],
    ) -> dict[str, Any]:
        coordinator, model, ids = await _transfer_targets(
            svc, transfers, data.model, data.nodes, "nodes"
        )
        try:
            pulls = coordinator.pull(model, ids)
        except TransferRefused as e:
            raise ApiError(409, str(e), code=ErrorCode.NO_SOURCE) from e
        return {
            "transfers": [
                {"node_id": p.node_id, "transfer_id": p.transfer_id, "sources": list(p.sources)}
                for p in pulls
            ]
        }

    @post(
        "/evict",
        status_code=200,
        summary="Delete a model's file from a node's disk (refused while jobs use it; an idle "
        "llama-server that has it loaded is stopped first)",
        operation_class=ApiOperation,
        responses={
            **success(ModelEvictionRow, "The file is gone (MODEL_EVICTED)"),
            **errors(
                400,
                *ADMIN_KEY_ERRORS,
                (404, "Unknown model or node (`model_not_found`, `node_not_found`)"),
                (409, "Jobs use it, it is being fetched, or the node is away (`model_in_use`)"),
                503,
            ),
        },
    )
    async def evict(
        self,
        svc: Provided[Services],
        transfers: Provided[TransferCoordinator | None],
        data: JSONBody[ModelEviction],
    ) -> dict[str, Any]:
        coordinator, model, (node_id,) = await _transfer_targets(
            svc, transfers, data.model, [data.node], "node"
        )
        try:
            file_name = await coordinator.evict(node_id, model)
        except TransferRefused as e:
            raise ApiError(409, str(e), code=ErrorCode.MODEL_IN_USE) from e
        return {"node_id": node_id, "model": data.model, "file_name": file_name}

    @post(
        "/sources",
        status_code=201,
        summary="Add an http(s) URL the model's file can be fetched from (MODEL_SOURCE_ADDED)",
        operation_class=ApiOperation,
        responses={
            **success(RegisteredModelRow, "The model with its sources", 201),
            **errors(
                (
                    400,
                    "A malformed URL, or one whose host is (or resolves to) a loopback, "
                    "link-local, cloud metadata, unspecified or multicast address outside "
                    "MODEL_SOURCE_ALLOWED_CIDRS (`source_refused`)",
                ),
                *ADMIN_KEY_ERRORS,
                (404, "Unknown model (`model_not_found`)"),
                503,
            ),
        },
    )
    async def add_source(
        self, svc: Provided[Services], data: JSONBody[ModelSource]
    ) -> dict[str, Any]:
        return await self._source(svc, data, add=True)

    @post(
        "/sources/remove",
        status_code=200,
        summary="Remove one of the model's http(s) sources (MODEL_SOURCE_REMOVED)",
        operation_class=ApiOperation,
        responses={
            **success(RegisteredModelRow, "The model with its sources"),
            **errors(
                400, *ADMIN_KEY_ERRORS, (404, "Unknown model or source (`model_not_found`)"), 503
            ),
        },
    )
    async def remove_source(
        self, svc: Provided[Services], data: JSONBody[ModelSource]
    ) -> dict[str, Any]:
        return await self._source(svc, data, add=False)

    async def _source(self, svc: Services, data: ModelSource, *, add: bool) -> dict[str, Any]:
        model = await asyncio.to_thread(svc.read_model.get_model, data.model)
        if model is None:
            raise await _no_model(svc, data.model)
        if not add and data.url not in (model.get("sources") or []):
            raise ApiError(
                404, f"model {data.model} has no source {data.url}", code=ErrorCode.MODEL_NOT_FOUND
            )
        if add:
            await _check_source(svc.settings.model_source_allowed_cidrs, data.url)
        command = svc.app.add_model_source if add else svc.app.remove_model_source
        result = await asyncio.to_thread(command, data.model, data.url)
        await asyncio.to_thread(svc.follower.wait, result.position, READ_YOUR_WRITES_TIMEOUT)
        row = await asyncio.to_thread(svc.read_model.get_model, data.model)
        assert row is not None
        return (await _with_holders(svc, [row]))[0]
