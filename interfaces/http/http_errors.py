"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from eventsourcing.persistence import DataError, PersistenceError
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from application.errors import ConcurrencyExhausted, NotFound
from application.store_guard import STORE_UNAVAILABLE, StoreUnavailable
from domain.errors import IllegalTransition, InvalidCommand


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}


#: ``Retry-After`` (seconds) from a part of the controller that is not running (yet): it
#: starts or stops. Every 503 says when to retry (see interfaces/http/http_docs.py).
NOT_RUNNING_RETRY_AFTER = 2


def not_running(message: str) -> ApiError:
    return ApiError(
        503,
        message,
        type_="server_error",
        headers={"Retry-After": str(NOT_RUNNING_RETRY_AFTER)},
    )


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(error: ApiError) -> Response[dict[str, Any]]:
    return Response(
        error_body(error.message, error.type, error.code, error.param),
        status_code=error.status,
        headers=error.headers,
    )


def _api_error(_: Request[Any, Any, Any], exc: ApiError) -> Response[dict[str, Any]]:
    return error_response(exc)


def _not_found(_: Request[Any, Any, Any], exc: NotFound) -> Response[dict[str, Any]]:
    return error_response(ApiError(404, str(exc), code=f"{exc.kind}_not_found"))


def _conflict(_: Request[Any, Any, Any], exc: IllegalTransition) -> Response[dict[str, Any]]:
    return error_response(ApiError(409, str(exc), type_="conflict", code="illegal_transition"))


def _invalid(_: Request[Any, Any, Any], exc: InvalidCommand) -> Response[dict[str, Any]]:
    return error_response(ApiError(400, str(exc), code="invalid_command"))


def _validation(_: Request[Any, Any, Any], exc: ValidationException) -> Response[dict[str, Any]]:
    detail = exc.extra if isinstance(exc.extra, list) else []
    param = None
    if detail and isinstance(detail[0], dict):
        param = detail[0].get("key")
        message = f"{exc.detail}: {detail[0].get('message', '')}".strip(": ")
    else:
        message = str(exc.detail)
    return error_response(ApiError(400, message, param=param, code="invalid_request"))


def _http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[dict[str, Any]]:
    if exc.status_code == 413:  # Litestar's body limit (MAX_REQUEST_BYTES)
        limit = request.app.request_max_body_size
        return error_response(
            ApiError(
                413,
                f"the request body is larger than {limit:,} bytes (MAX_REQUEST_BYTES)",
                code="request_too_large",
            )
        )
    type_ = "not_found_error" if isinstance(exc, NotFoundException) else "invalid_request_error"
    return error_response(ApiError(exc.status_code, str(exc.detail), type_=type_))


def _unavailable(_: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """The store is slow or contended: retry shortly, nothing was half-recorded."""
    return error_response(
        ApiError(
            503,
            f"the controller's store is busy or unreachable, retry shortly ({exc})",
            type_="server_error",
            code=STORE_UNAVAILABLE,
            headers={"Retry-After": "2"},
        )
    )


def _internal(_: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    import logging

    logging.getLogger(__name__).exception("unhandled error", exc_info=exc)
    return error_response(
        ApiError(500, "internal error; see the controller log", type_="server_error")
    )


#: Litestar picks the handler of the closest class in the exception's MRO: a ``DataError`` (the
#: store refused a value, e.g. a NUL byte in a Postgres text) is our bug, not a busy store, and
#: retrying would not help, so it is a logged 500 rather than a 503 with ``Retry-After``.
EXCEPTION_HANDLERS: dict[Any, Any] = {
    ApiError: _api_error,
    NotFound: _not_found,
    IllegalTransition: _conflict,
    InvalidCommand: _invalid,
    ValidationException: _validation,
    HTTPException: _http,
    TimeoutError: _unavailable,
    ConcurrencyExhausted: _unavailable,
    PersistenceError: _unavailable,
    DataError: _internal,
    StoreUnavailable: _unavailable,
    Exception: _internal,
}
