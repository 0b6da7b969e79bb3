"""Admin API for usage per API key (``ADMIN_API_KEY``): ``GET /api/admin/usage``.

Requests and tokens of the jobs that ended, by key, model and day as asked, summed in the
store's ``jobs`` view (so the answer survives restarts and agrees with ``dacp usage``);
``application/usage.py`` says what counts.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal, TypedDict

from litestar import get
from litestar.params import QueryParameter

from application.usage import (
    GROUPS,
    KEY_ID_PATTERN,
    UsageQueryError,
    usage_query,
    usage_report,
)
from interfaces.http.admin.admin_jobs_api import MODEL_FILTER_PATTERN
from interfaces.http.admin.admin_routes import AdminController
from interfaces.http.http_docs import ADMIN_KEY_ERRORS, ApiOperation, errors, success
from interfaces.http.http_errors import ApiError, ErrorCode
from interfaces.services import Provided, Services


class UsageCounts(TypedDict):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageRow(UsageCounts):
    """One group: its key (null unless grouped by key), the key's name where it is known,
    its model and its day (``YYYY-MM-DD``, UTC; each null unless grouped by it)."""

    key_id: str | None
    key_name: str | None
    model: str | None
    day: str | None


#: The filters as used: ``from`` inclusive, ``to`` exclusive (a date alone given as ``to`` is
#: the start of the next day), both UTC; null where none was given.
UsageFilters = TypedDict(
    "UsageFilters", {"key": str | None, "model": str | None, "from": str | None, "to": str | None}
)


class UsageReport(TypedDict):
    object: Literal["usage"]
    filters: UsageFilters
    group_by: list[str]
    data: list[UsageRow]
    totals: UsageCounts


#: What ``from`` and ``to`` take, for the schema: a date or a date and time.
_ISO_WHEN: dict[str, Any] = {"anyOf": [{"format": "date"}, {"format": "date-time"}]}
_WHEN = "an ISO 8601 date (2026-01-31) or time (2026-01-31T12:00:00Z; no zone: UTC)"


class AdminUsageRoutes(AdminController):
    path = "/api/admin"

    @get(
        "/usage",
        summary="Requests and tokens per API key, model and day (jobs that ended)",
        operation_class=ApiOperation,
        responses={
            **success(UsageReport, "The groups asked for and their totals"),
            **errors(400, *ADMIN_KEY_ERRORS, 503),
        },
    )
    async def usage(
        self,
        svc: Provided[Services],
        key: Annotated[
            str | None,
            QueryParameter(
                description="only this key id", schema_extra={"pattern": KEY_ID_PATTERN}
            ),
        ] = None,
        model: Annotated[
            str | None,
            QueryParameter(
                description="only this model", schema_extra={"pattern": MODEL_FILTER_PATTERN}
            ),
        ] = None,
        start: Annotated[
            str | None,
            QueryParameter(
                name="from",
                description=f"jobs that ended at or after {_WHEN}",
                schema_extra=_ISO_WHEN,
            ),
        ] = None,
        end: Annotated[
            str | None,
            QueryParameter(
                name="to",
                description=f"jobs that ended before {_WHEN}; a date alone includes that day",
                schema_extra=_ISO_WHEN,
            ),
        ] = None,
        group_by: Annotated[
            str | None,
            QueryParameter(
                description=f"any of {', '.join(GROUPS)}, comma-separated (default key,model; "
                "empty: the totals alone)",
                schema_extra={"pattern": f"^(?:(?:{'|'.join(GROUPS)})(?:,|$))*$"},
            ),
        ] = None,
    ) -> dict[str, Any]:
        try:
            query = usage_query(key=key, model=model, start=start, end=end, group_by=group_by)
        except UsageQueryError as e:
            raise ApiError(400, e.message, param=e.param, code=ErrorCode.INVALID_VALUE) from e
        return await asyncio.to_thread(usage_report, svc.read_model, query)
