"""Admin API for jobs and event timelines (``ADMIN_API_KEY``).

``GET /api/admin/jobs`` (filters and pagination over the ``jobs`` view), one job with its
plan, nodes and timings, and the event timelines of a job or a node: the same entries as
``dacp events … --json`` (:func:`application.timeline.timeline`).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any
from uuid import UUID

from litestar import get
from litestar.openapi.spec.enums import OpenAPIFormat
from litestar.params import PathParameter, QueryParameter

from application.timeline import job_timeline, parse_time, timeline, timeline_kind
from domain.model import MODEL_NAME_PATTERN, is_model_name
from domain.states import JobState
from interfaces.http.admin.admin_api import UUID_PATTERN, NodeId, canonical_id
from interfaces.http.admin.admin_routes import AdminController
from interfaces.http.http_docs import (
    ADMIN_KEY_ERRORS,
    ApiOperation,
    JobTimeline,
    JobView,
    JobViews,
    NodeTimeline,
    errors,
    success,
)
from interfaces.http.http_errors import ApiError, ErrorCode, not_found
from interfaces.services import Provided, Services

MAX_LIMIT = 200
DEFAULT_LIMIT = 50
#: Deeper pages than this are refused (the store's OFFSET is a 64-bit integer).
MAX_OFFSET = 1_000_000_000
#: The filters as documented: an empty value filters nothing. A state in any ASCII case,
#: e.g. ``FAILED`` or ``failed``; a model's name; a node's id.
STATE_PATTERN = "^(?:{})?$".format(
    "|".join(
        "".join(f"[{c}{c.lower()}]" if c.isalpha() else c for c in name)
        for name in JobState.__members__
    )
)
MODEL_FILTER_PATTERN = f"^(?:{MODEL_NAME_PATTERN.removeprefix('^').removesuffix('$')})?$"
NODE_FILTER_PATTERN = f"^(?:{UUID_PATTERN})?$"

JobId = Annotated[str, PathParameter(format=OpenAPIFormat.UUID, description="The job's id")]


def _ms_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        return round((parse_time(end) - parse_time(start)).total_seconds() * 1000, 3)
    except ValueError:
        return None


def timings(row: dict[str, Any]) -> dict[str, Any]:
    """How long each phase of a job took (ms), and the runtime's own figures."""
    return {
        "queue_wait_ms": _ms_between(
            row.get("queued_at"), row.get("planned_at") or row.get("ended_at")
        ),
        "planning_ms": _ms_between(row.get("submitted_at"), row.get("planned_at")),
        "setup_ms": _ms_between(row.get("dispatched_at"), row.get("validated_at")),
        "first_token_after_submit_ms": _ms_between(
            row.get("submitted_at"), row.get("first_token_at")
        ),
        "total_ms": _ms_between(row.get("submitted_at"), row.get("ended_at")),
        "time_to_first_token_ms": row.get("time_to_first_token_ms"),
        "tokens_per_second": row.get("tokens_per_second"),
    }


def job_view(row: dict[str, Any], *, full: bool) -> dict[str, Any]:
    """A job row for the API; lists leave out the generated text."""
    view = {"object": "admin.job", **row}
    if not full:
        view.pop("text", None)
    # How its server was chosen, and what llama-server's cache saved: null in older rows.
    view.setdefault("route", None)
    view.setdefault("cached_prompt_tokens", None)
    state = row.get("state")
    view["failure"] = (
        {"phase": row.get("failure_phase"), "reason": row.get("failure_reason")}
        if state == JobState.FAILED
        # The client's error: its request, not a phase of the job's run.
        else {"phase": "request", "reason": row.get("failure_reason")}
        if state == JobState.REJECTED
        else None
    )
    view["timings"] = timings(row)
    return view


#: What the jobs API looks up, and the code of a 404 for each.
_NOT_FOUND: dict[str, ErrorCode] = {
    "job": ErrorCode.JOB_NOT_FOUND,
    "node": ErrorCode.NODE_NOT_FOUND,
}


def _not_found(kind: str, ident: str) -> ApiError:
    return not_found(f"unknown {kind} {ident}", _NOT_FOUND[kind])


def _bad_filter(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code=ErrorCode.INVALID_VALUE)


def _job_state(given: str) -> str:
    wanted = given.upper() if given.isascii() else ""
    if wanted not in JobState.__members__:
        raise ApiError(
            400,
            f"state must be one of {', '.join(JobState.__members__)}",
            param="state",
            code=ErrorCode.INVALID_STATE,
        )
    return wanted


class AdminJobRoutes(AdminController):
    path = "/api/admin"

    @get(
        "/jobs",
        summary="Recent and active jobs, newest first",
        operation_class=ApiOperation,
        responses={
            **success(JobViews, "One page of jobs (without their generated text)"),
            **errors(400, *ADMIN_KEY_ERRORS, 503),
        },
    )
    async def list_jobs(
        self,
        svc: Provided[Services],
        job_state: Annotated[
            str | None,
            QueryParameter(
                name="state",
                description=f"One of {', '.join(JobState.__members__)} (any case)",
                schema_extra={"pattern": STATE_PATTERN},
            ),
        ] = None,
        model: Annotated[
            str | None,
            QueryParameter(
                description="model API name", schema_extra={"pattern": MODEL_FILTER_PATTERN}
            ),
        ] = None,
        node_id: Annotated[
            str | None,
            QueryParameter(
                description="jobs that ran on this node",
                schema_extra={"pattern": NODE_FILTER_PATTERN},
            ),
        ] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
        offset: Annotated[int, QueryParameter(ge=0, le=MAX_OFFSET)] = 0,
    ) -> dict[str, Any]:
        # The filters' patterns are documented only (schema_extra): they are checked here,
        # whole, before anything reaches the store, and an error names the query parameter.
        wanted = _job_state(job_state) if job_state else None
        if model and not is_model_name(model):
            raise _bad_filter("model", f"{model!r} is not a model name")
        node = None
        if node_id:
            node = canonical_id(node_id, _bad_filter("node_id", "node_id must be a node's id"))
        rows = await asyncio.to_thread(
            svc.read_model.list_jobs,
            state=wanted,
            model=model or None,
            node_id=node,
            limit=limit + 1,
            offset=offset,
        )
        return {
            "object": "list",
            "data": [job_view(r, full=False) for r in rows[:limit]],
            "limit": limit,
            "offset": offset,
            "has_more": len(rows) > limit,
        }

    @get(
        "/jobs/{job_id:str}",
        summary="One job: plan, nodes, timings, failure",
        operation_class=ApiOperation,
        responses={
            **success(JobView, "The job, with its generated text"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown job"), 503),
        },
    )
    async def get_job(self, svc: Provided[Services], job_id: JobId) -> dict[str, Any]:
        key = canonical_id(job_id, _not_found("job", job_id))
        row = await asyncio.to_thread(svc.read_model.get_job, key)
        if row is None:
            raise _not_found("job", job_id)
        return job_view(row, full=True)

    async def _timeline(self, svc: Services, kind: str, ident: str) -> dict[str, Any]:
        uid = UUID(canonical_id(ident, _not_found(kind, ident)))
        if await asyncio.to_thread(timeline_kind, svc.app, uid) != kind:
            raise _not_found(kind, ident)
        story = job_timeline if kind == "job" else timeline
        entries = await asyncio.to_thread(story, svc.app, uid)
        return {"object": "list", f"{kind}_id": str(uid), "data": entries}

    @get(
        "/jobs/{job_id:str}/events",
        summary="A job's events and the node events about it (RPC workers, slots), in order",
        operation_class=ApiOperation,
        responses={
            **success(JobTimeline, "The job's timeline"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown job"), 503),
        },
    )
    async def job_events(self, svc: Provided[Services], job_id: JobId) -> dict[str, Any]:
        return await self._timeline(svc, "job", job_id)

    @get(
        "/nodes/{node_id:str}/events",
        summary="A node's events, oldest first",
        operation_class=ApiOperation,
        responses={
            **success(NodeTimeline, "The node's timeline"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown node"), 503),
        },
    )
    async def node_events(self, svc: Provided[Services], node_id: NodeId) -> dict[str, Any]:
        return await self._timeline(svc, "node", node_id)
