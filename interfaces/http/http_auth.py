"""Bearer-key guards for the admin (``ADMIN_API_KEY``) and inference APIs.

The inference guard resolves the bearer key to a :class:`~domain.api_keys.Grant`: ``AI_API_KEY``
is :data:`~domain.api_keys.BOOTSTRAP`; a managed key (``sk-dacp-…``, ``application/api_keys.py``)
is its own Grant, checked against the event store on every request, so a revoked or expired key
fails at once; a cluster with no ``AI_API_KEY`` and no live managed key is open
(:data:`~domain.api_keys.OPEN`). Anything else is 401 ``invalid_api_key`` (``missing_api_key``
without a key).

Handlers read the Grant as a dependency: declare ``grant: Provided[Grant]`` (the app provides
``grant`` with :func:`granted`, which reads what the guard left in the connection's state), or,
in the generating handlers, ``call: Provided[InferenceCall]`` (interfaces/http/inference_call.py),
which holds it. Both exist only on routes that ``inference_guard`` guards.
"""

from __future__ import annotations

import asyncio
import hmac
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from domain.api_key import KEY_PREFIX
from domain.api_keys import BOOTSTRAP, OPEN, Grant
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


#: Where :func:`inference_guard` leaves the request's Grant in the connection's state.
GRANT_STATE = "dacp_grant"


def _inference_refusal(given: str | None) -> ApiError:
    if given is None:
        return ApiError(
            401,
            "You didn't provide an API key. Send 'Authorization: Bearer <API key>'.",
            type_="invalid_request_error",
            code=ErrorCode.MISSING_API_KEY,
        )
    return ApiError(
        401,
        "Incorrect API key provided.",
        type_="invalid_request_error",
        code=ErrorCode.INVALID_API_KEY,
    )


async def resolve_grant(connection: ASGIConnection[Any, Any, Any, Any]) -> Grant:
    """The Grant of the request's bearer key, or the 401 (counted) that refuses it."""
    svc = services_of(connection)
    given = bearer(connection)
    expected = svc.settings.ai_api_key
    if given is not None and expected and hmac.compare_digest(given.encode(), expected.encode()):
        return BOOTSTRAP
    now = datetime.now(UTC)
    if given is not None and given.startswith(KEY_PREFIX):
        grant = await asyncio.to_thread(svc.keys.check, given, now)
        if grant is not None:
            return grant
    if not expected and not await asyncio.to_thread(svc.keys.any_live, now):
        return OPEN  # an open cluster: no AI_API_KEY and no managed key that works
    raise _refused(connection, "inference", _inference_refusal(given))


async def inference_guard(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Lets a request with a working inference key in, its Grant in the connection's state."""
    connection.state[GRANT_STATE] = await resolve_grant(connection)


def granted(request: Request[Any, Any, Any]) -> Grant:
    """The ``grant`` dependency: the Grant :func:`inference_guard` resolved for this request."""
    grant = request.state.get(GRANT_STATE)
    if not isinstance(grant, Grant):
        raise RuntimeError("no Grant: the route is not guarded by inference_guard")
    return grant
