"""Bearer-key guards for the admin (``ADMIN_API_KEY``) and inference (``AI_API_KEY``) APIs."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from interfaces.http.http_errors import ApiError, ErrorCode

if TYPE_CHECKING:  # interfaces.services imports the feed, which these guards protect
    from interfaces.services import Services


def bearer(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    header = connection.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def services_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Services:
    """The app's services, for guards (which Litestar gives no dependencies):
    :func:`interfaces.http.http_app.create_app` keeps them in the app's state."""
    services: Services = connection.app.state.services
    return services


def _refused(connection: ASGIConnection[Any, Any, Any, Any], api: str, error: ApiError) -> ApiError:
    """``error``, counted in /metrics (``dacp_http_auth_failures_total``) first."""
    services_of(connection).auth_failures[(api, error.status)] += 1
    return error


def _check_key(
    connection: ASGIConnection[Any, Any, Any, Any],
    api: str,
    given: str | None,
    expected: str,
    *,
    missing: ApiError,
    wrong: ApiError,
) -> None:
    """Raises ``missing`` when no key was sent, ``wrong`` when it is not ``expected`` (compared
    in constant time), each counted for ``api`` first."""
    if given is None:
        raise _refused(connection, api, missing)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise _refused(connection, api, wrong)


def check_admin_key(connection: ASGIConnection[Any, Any, Any, Any], given: str | None) -> None:
    """Raises the admin API's 403/401/403 errors unless ``given`` is the admin key."""
    expected = services_of(connection).settings.admin_api_key
    if not expected:
        raise ApiError(
            403,
            "the admin API is disabled: set ADMIN_API_KEY on the controller",
            type_="permission_error",
            code=ErrorCode.ADMIN_DISABLED,
        )
    _check_key(
        connection,
        "admin",
        given,
        expected,
        missing=ApiError(
            401,
            "missing admin key: send 'Authorization: Bearer <ADMIN_API_KEY>'",
            type_="authentication_error",
            code=ErrorCode.MISSING_API_KEY,
        ),
        wrong=ApiError(
            403, "invalid admin key", type_="permission_error", code=ErrorCode.INVALID_API_KEY
        ),
    )


def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    check_admin_key(connection, bearer(connection))


def inference_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    expected = services_of(connection).settings.ai_api_key
    if not expected:
        return  # an open cluster: no AI_API_KEY configured
    _check_key(
        connection,
        "inference",
        bearer(connection),
        expected,
        missing=ApiError(
            401,
            "You didn't provide an API key. Send 'Authorization: Bearer <AI_API_KEY>'.",
            type_="invalid_request_error",
            code=ErrorCode.MISSING_API_KEY,
        ),
        wrong=ApiError(
            401,
            "Incorrect API key provided.",
            type_="invalid_request_error",
            code=ErrorCode.INVALID_API_KEY,
        ),
    )
