"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``, and the
codes this HTTP layer names itself (:class:`ErrorCode`).

The codes live here, not in ``common/contract.py``: that module holds what the controller and its
agents both hold to, and only the controller answers HTTP clients; an agent never sees these.
What an agent and the controller share is the code of a failed job
(``common.contract.JobErrorCode``), which reaches a client as it is (``ApiError``'s ``code`` is
then that code, or the controller's own failure code, as a ``str``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from eventsourcing.persistence import DataError, PersistenceError
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from application.errors import ConcurrencyExhausted, NotFound
from application.store_guard import STORE_UNAVAILABLE, StoreUnavailable
from domain.errors import IllegalTransition, InvalidCommand


class ErrorCode(StrEnum):
    """The ``code`` of an error the HTTP layer answers with itself (OpenAI's where it has one)."""

    #: The request body: not JSON, too large, or a field missing, wrong, unknown or unsupported.
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"
    REQUEST_TOO_LARGE = "request_too_large"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    INVALID_VALUE = "invalid_value"
    INVALID_COMBINATION = "invalid_combination"
    UNKNOWN_PARAMETER = "unknown_parameter"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    INVALID_STATE = "invalid_state"
    INVALID_NODE_NAME = "invalid_node_name"
    #: A model source URL the controller will not fetch from.
    SOURCE_REFUSED = "source_refused"
    #: Keys.
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    ADMIN_DISABLED = "admin_disabled"
    ENROLLMENT_DISABLED = "enrollment_disabled"
    INVALID_TICKET = "invalid_ticket"
    #: What the request names is not there, or not for this endpoint.
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_SUPPORTED = "model_not_supported"
    NODE_NOT_FOUND = "node_not_found"
    JOB_NOT_FOUND = "job_not_found"
    TOKEN_NOT_FOUND = "token_not_found"
    API_KEY_NOT_FOUND = "api_key_not_found"
    #: The command does not fit the state of what it acts on.
    ILLEGAL_TRANSITION = "illegal_transition"
    INVALID_COMMAND = "invalid_command"
    NO_SOURCE = "no_source"
    MODEL_IN_USE = "model_in_use"


class ApiError(Exception):
    """An error answer. ``code``: an :class:`ErrorCode`, or a code passed through as it is from
    below (a failed job's, an application error's)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: ErrorCode | str | None = None,
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


def not_found(message: str, code: ErrorCode) -> ApiError:
    """404 ``not_found_error``: what the request names (``code`` says what kind) is not there."""
    return ApiError(404, message, type_="not_found_error", code=code)


#: The codes by value: an application's NotFound names its kind, and the code is its own.
_CODES: dict[str, ErrorCode] = {code.value: code for code in ErrorCode}


def not_found_code(kind: str) -> ErrorCode | str:
    """``<kind>_not_found``: the :class:`ErrorCode` of that value, or for a kind the HTTP layer
    names no code for (an aggregate's class name), that text as it is."""
    code = f"{kind}_not_found"
    return _CODES.get(code, code)


def error_body(
    message: str, type_: str, code: ErrorCode | str | None = None, param: str | None = None
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
    return error_response(ApiError(404, str(exc), code=not_found_code(exc.kind)))


def _conflict(_: Request[Any, Any, Any], exc: IllegalTransition) -> Response[dict[str, Any]]:
    return error_response(
        ApiError(409, str(exc), type_="conflict", code=ErrorCode.ILLEGAL_TRANSITION)
    )


def _invalid(_: Request[Any, Any, Any], exc: InvalidCommand) -> Response[dict[str, Any]]:
    return error_response(ApiError(400, str(exc), code=ErrorCode.INVALID_COMMAND))


def _validation(_: Request[Any, Any, Any], exc: ValidationException) -> Response[dict[str, Any]]:
    detail = exc.extra if isinstance(exc.extra, list) else []
    param = None
    if detail and isinstance(detail[0], dict):
        param = detail[0].get("key")
        message = f"{exc.detail}: {detail[0].get('message', '')}".strip(": ")
    else:
        message = str(exc.detail)
    return error_response(ApiError(400, message, param=param, code=ErrorCode.INVALID_REQUEST))


def _http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[dict[str, Any]]:
    if exc.status_code == 413:  # Litestar's body limit (MAX_REQUEST_BYTES)
        limit = request.app.request_max_body_size
        return error_response(
            ApiError(
                413,
                f"the request body is larger than {limit:,} bytes (MAX_REQUEST_BYTES)",
                code=ErrorCode.REQUEST_TOO_LARGE,
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
