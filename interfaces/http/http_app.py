"""The Litestar application: OpenAI-compatible API, admin API, health."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Litestar, Request, Router
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

from application.version import CONTROLLER_VERSION
from domain.api_keys import Grant
from infrastructure.settings import DEFAULT_MAX_REQUEST_BYTES
from interfaces.http.admin.admin_api import AdminRoutes, health
from interfaces.http.admin.admin_jobs_api import AdminJobRoutes
from interfaces.http.admin.api_keys_api import AdminApiKeyRoutes
from interfaces.http.admin.event_feed import event_stream
from interfaces.http.admin.models_api import AdminModelRoutes
from interfaces.http.admin.operations_api import operations_handlers
from interfaces.http.admin.usage_api import AdminUsageRoutes
from interfaces.http.http_auth import granted
from interfaces.http.http_errors import EXCEPTION_HANDLERS, not_running
from interfaces.http.inference_call import InferenceCall
from interfaces.http.openai.openai_api import (
    chat_completions,
    completions,
    create_embeddings,
    get_model,
    list_models,
)
from interfaces.services import Provided, Services

BEARER: list[dict[str, list[str]]] = [{"BearerAuth": []}]


def _body_limit(services: Services | None) -> int:
    """MAX_REQUEST_BYTES (the default for an app built without services: the schema)."""
    return (
        services.settings.max_request_bytes if services is not None else DEFAULT_MAX_REQUEST_BYTES
    )


def dependencies(services: Services | None) -> dict[str, Provide]:
    """What handlers declare by name: ``svc`` (the services: 503 in an app built without
    them), each running part, None where this app runs without it (the route says so),
    ``grant``, the Grant of an inference request's key (``inference_guard``'s routes only), and
    ``call``, the generating handlers' one dependency (:class:`InferenceCall`)."""

    def svc() -> Services:
        if services is None:
            raise not_running("the controller's services are not running")
        return services

    def part(of: Callable[[Services], object]) -> Callable[[], object]:
        def provide() -> object:
            return of(services) if services is not None else None

        return provide

    parts: dict[str, Callable[[Services], object]] = {
        "jobs": lambda s: s.jobs,
        "transfers": lambda s: s.transfers,
        "claims": lambda s: s.claims,
        "metrics": lambda s: s.metrics,
        "feed": lambda s: s.feed,
        "history": lambda s: s.history,
        "steering": lambda s: s.steering,
    }

    def call(request: Request[Any, Any, Any]) -> InferenceCall:
        return InferenceCall(svc(), svc().jobs, granted(request))

    return {
        "svc": Provide(svc, sync_to_thread=False),
        "grant": Provide(granted, sync_to_thread=False),
        "call": Provide(call, sync_to_thread=False),
    } | {name: Provide(part(of), sync_to_thread=False) for name, of in parts.items()}


def create_app(services: Services | None, extra_handlers: list[Any] | None = None) -> Litestar:
    app = Litestar(
        route_handlers=[
            health,
            AdminRoutes,
            AdminModelRoutes,
            AdminJobRoutes,
            AdminApiKeyRoutes,
            AdminUsageRoutes,
            # The OpenAI routes check AI_API_KEY in their guard; the router documents it.
            Router(
                "/",
                route_handlers=[
                    chat_completions,
                    completions,
                    create_embeddings,
                    list_models,
                    get_model,
                ],
                security=BEARER,
            ),
            event_stream,
            *operations_handlers(),
            *(extra_handlers or []),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        dependencies=dependencies(services),
        # Modules that import Services for type checking only (it holds their parts).
        signature_namespace={
            "Services": Services,
            "Provided": Provided,
            "Grant": Grant,
            "InferenceCall": InferenceCall,
        },
        openapi_config=OpenAPIConfig(
            title="Distributed AI Compute Platform",
            version=CONTROLLER_VERSION,
            components=Components(
                security_schemes={
                    "BearerAuth": SecurityScheme(type="http", scheme="bearer"),
                }
            ),
        ),
        debug=False,
        # Larger bodies are refused before they are read: 413 in OpenAI's error shape.
        request_max_body_size=_body_limit(services),
    )
    app.state.services = services  # for the guards (interfaces.http.http_auth.services_of)
    return app
