"""The Litestar application: OpenAI-compatible API, admin API, health."""

from __future__ import annotations

from typing import Any

from litestar import Litestar
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

from application.version import CONTROLLER_VERSION
from interfaces.admin_api import AdminRoutes, health
from interfaces.http_errors import EXCEPTION_HANDLERS
from interfaces.services import Services


def create_app(services: Services, extra_handlers: list[Any] | None = None) -> Litestar:
    app = Litestar(
        route_handlers=[health, AdminRoutes, *(extra_handlers or [])],
        exception_handlers=EXCEPTION_HANDLERS,
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
    )
    app.state.services = services
    return app
