"""Admin API for jobs and event timelines (``ADMIN_API_KEY``).

``GET /api/admin/jobs`` (filters and pagination over the ``jobs`` view), one job with its
plan, nodes and timings, and the event timelines of a job or a node: the same entries as
``dacp events … --json`` (:func:`application.timeline.timeline`).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from litestar import Controller as Routes
from litestar import get
from litestar.datastructures import State
from litestar.params import FromPath, QueryParameter

from application.timeline import as_uuid, job_timeline, parse_time, timeline, timeline_kind
from domain.states import JobState
from interfaces.http_auth import admin_guard
from interfaces.http_errors import ApiError
from interfaces.services import Services

MAX_LIMIT = 200
DEFAULT_LIMIT = 50


def _services(state: State) -> Services:
    return state.services  # type: ignore[no-any-return]


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
    view["failure"] = (
        {"phase": row.get("failure_phase"), "reason": row.get("failure_reason")}
        if row.get("state") == JobState.FAILED
        else None
    )
    view["timings"] = timings(row)
    return view


def _not_found(kind: str, ident: str) -> ApiError:
    return ApiError(
        404, f"unknown {kind} {ident}", type_="not_found_error", code=f"{kind}_not_found"
    )


class AdminJobRoutes(Routes):
    path = "/api/admin"
    guards = [admin_guard]
    tags = ["admin"]
    security = [{"BearerAuth": []}]

    @get("/jobs", summary="Recent and active jobs, newest first")
    async def list_jobs(
        self,
        state: State,
        job_state: Annotated[
            str | None, QueryParameter(name="state", description="e.g. RUNNING, FAILED")
        ] = None,
        model: Annotated[str | None, QueryParameter(description="model API name")] = None,
        node_id: Annotated[
            str | None, QueryParameter(description="jobs that ran on this node")
        ] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
        offset: Annotated[int, QueryParameter(ge=0)] = 0,
    ) -> dict[str, Any]:
        wanted = None
        if job_state:
            wanted = job_state.strip().upper()
            if wanted not in JobState.__members__:
                raise ApiError(
                    400,
                    f"state must be one of {', '.join(JobState.__members__)}",
                    param="state",
                    code="invalid_state",
                )
        svc = _services(state)
        rows = await asyncio.to_thread(
            svc.read_model.list_jobs,
            state=wanted,
            model=model or None,
            node_id=node_id or None,
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

    @get("/jobs/{job_id:str}", summary="One job: plan, nodes, timings, failure")
    async def get_job(self, state: State, job_id: FromPath[str]) -> dict[str, Any]:
        row = await asyncio.to_thread(_services(state).read_model.get_job, job_id)
        if row is None:
            raise _not_found("job", job_id)
        return job_view(row, full=True)

    async def _timeline(self, svc: Services, kind: str, ident: str) -> dict[str, Any]:
        uid = as_uuid(ident)
        if uid is None or await asyncio.to_thread(timeline_kind, svc.app, uid) != kind:
            raise _not_found(kind, ident)
        story = job_timeline if kind == "job" else timeline
        entries = await asyncio.to_thread(story, svc.app, uid)
        return {"object": "list", f"{kind}_id": str(uid), "data": entries}

    @get(
        "/jobs/{job_id:str}/events",
        summary="A job's events and the node events about it (RPC workers, slots), in order",
    )
    async def job_events(self, state: State, job_id: FromPath[str]) -> dict[str, Any]:
        return await self._timeline(_services(state), "job", job_id)

    @get("/nodes/{node_id:str}/events", summary="A node's events, oldest first")
    async def node_events(self, state: State, node_id: FromPath[str]) -> dict[str, Any]:
        return await self._timeline(_services(state), "node", node_id)
