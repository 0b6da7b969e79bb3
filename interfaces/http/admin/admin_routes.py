"""The base of the admin API's route classes: the admin key guards every route, and the
OpenAPI document says so (tag ``admin``, bearer security)."""

from __future__ import annotations

from litestar import Controller

from interfaces.http.http_auth import admin_guard


class AdminController(Controller):
    """Routes under the admin key; a subclass sets ``path`` and defines the handlers."""

    guards = [admin_guard]
    tags = ["admin"]
    security = [{"BearerAuth": []}]
