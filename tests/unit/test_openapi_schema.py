"""``/schema/openapi.json`` documents every HTTP route, each secured unless it is public."""

from __future__ import annotations

from typing import Any

import pytest
from litestar import Litestar
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from domain.model import MODEL_NAME_PATTERN
from interfaces.http.http_app import create_app

PUBLIC = {"/health", "/metrics"}
EXPECTED = {
    "/health",
    "/metrics",
    "/metrics/nodes",
    "/v1/chat/completions",
    "/v1/models",
    "/api/admin/nodes",
    "/api/admin/nodes/{node_id}",
    "/api/admin/nodes/{node_id}/drain",
    "/api/admin/nodes/{node_id}/resume",
    "/api/admin/nodes/{node_id}/events",
    "/api/admin/enrollment-tokens",
    "/api/admin/models",
    "/api/admin/jobs",
    "/api/admin/jobs/{job_id}",
    "/api/admin/jobs/{job_id}/events",
    "/api/admin/events/stream",
    "/api/admin/metrics/history",
    "/api/admin/agent-setup",
}
#: Served, deliberately not API: the dashboard page and its static files.
NOT_API = ("/dashboard", "/schema")


@pytest.fixture(scope="module")
def app() -> Litestar:
    return create_app(services=None)  # the schema needs no services


@pytest.fixture(scope="module")
def schema(app: Litestar) -> dict[str, Any]:
    with TestClient(app) as client:
        response = client.get("/schema/openapi.json")
        assert response.status_code == 200
        body: dict[str, Any] = response.json()
        return body


def documented_path(route_path: str) -> str:
    """Litestar's ``/nodes/{node_id:str}`` as OpenAPI writes it: ``/nodes/{node_id}``."""
    parts = []
    for part in route_path.split("/"):
        if part.startswith("{") and ":" in part:
            part = part.split(":", 1)[0] + "}"
        parts.append(part)
    return "/".join(parts)


def test_every_api_route_is_documented(app: Litestar, schema: dict[str, Any]) -> None:
    paths = set(schema["paths"])
    assert EXPECTED <= paths, sorted(EXPECTED - paths)
    for route in app.routes:
        if not isinstance(route, HTTPRoute) or route.path.startswith(NOT_API):
            continue
        for handler in route.route_handlers:
            if handler.include_in_schema:
                path = documented_path(route.path)
                assert path in paths, path
                for method in handler.http_methods:
                    assert method.lower() in schema["paths"][path], (method, path)


def test_every_non_public_operation_requires_the_bearer_key(schema: dict[str, Any]) -> None:
    scheme = schema["components"]["securitySchemes"]["BearerAuth"]
    assert scheme == {"type": "http", "scheme": "bearer"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            security = operation.get("security")
            if path in PUBLIC:
                assert not security, (method, path)
            else:
                assert security == [{"BearerAuth": []}], (method, path, security)


def test_the_event_stream_documents_its_ticket(schema: dict[str, Any]) -> None:
    operation = schema["paths"]["/api/admin/events/stream"]["get"]
    params = {(p["name"], p["in"]) for p in operation.get("parameters", [])}
    assert ("ticket", "query") in params and ("access_token", "query") not in params
    assert "text/event-stream" in str(operation["responses"])


def test_the_dashboard_is_served_with_a_strict_policy(app: Litestar) -> None:
    with TestClient(app) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "connect-src 'self'" in policy and "script-src 'self'" in policy
        assert 'src="/dashboard/static/dashboard.js"' in page.text
        for asset in ("dashboard.js", "dashboard.css"):
            assert client.get(f"/dashboard/static/{asset}").status_code == 200


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
    ]


def test_errors_are_documented_in_openai_shape(schema: dict[str, Any]) -> None:
    """They were undocumented (401, 403, 404, 503...) or documented in Litestar's own shape
    (400 ``{status_code, detail, extra}``), so no client could rely on the schema."""
    error = {"$ref": "#/components/schemas/ErrorBody"}
    detail = schema["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    for method, path, operation in operations(schema):
        responses = operation["responses"]
        if path not in PUBLIC:
            assert "401" in responses, (method, path)
            if path.startswith("/api/admin"):
                assert "403" in responses, (method, path)
        for status, response in responses.items():
            if int(status) < 400 or path == "/health":
                continue
            assert response["content"]["application/json"]["schema"] == error, (path, status)


def test_every_503_says_when_to_retry(schema: dict[str, Any]) -> None:
    busy = [(p, o["responses"]["503"]) for _, p, o in operations(schema) if "503" in o["responses"]]
    assert len(busy) >= 12
    for path, response in busy:
        header = response["headers"]["Retry-After"]
        assert header["required"] is True and header["schema"]["type"] == "integer", path


def test_the_chat_completion_documents_its_body_and_stream(schema: dict[str, Any]) -> None:
    operation = schema["paths"]["/v1/chat/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert operation["requestBody"]["required"] is True
    assert set(body["required"]) == {"model", "messages"}
    assert body["properties"]["messages"]["minItems"] == 1
    assert body["properties"]["seed"]["maximum"] == (1 << 63) - 1
    assert set(operation["responses"]["200"]["content"]) == {
        "application/json",
        "text/event-stream",
    }
    for status in ("400", "404", "413", "503"):
        assert status in operation["responses"]


def test_ids_are_documented_as_uuids(schema: dict[str, Any]) -> None:
    """Node, job and model ids are UUIDs; a token id is the hex the token carries; an OpenAI
    model is named."""
    for _, path, operation in operations(schema):
        for parameter in operation.get("parameters", []):
            if parameter["in"] != "path":
                continue
            if parameter["name"] == "token_id":
                assert parameter["schema"]["pattern"] == "^[0-9a-f]{1,64}$", path
            elif path == "/v1/models/{model}":
                assert MODEL_NAME_PATTERN in parameter["description"]
            else:
                assert parameter["schema"]["format"] == "uuid", (path, parameter["name"])


def test_a_node_documents_its_failed_transfers(schema: dict[str, Any]) -> None:
    """Every node answer carries ``transfer_failures`` (empty for rows older than the field),
    each entry with its file, how far it got, its error and when, described."""
    components = schema["components"]["schemas"]
    node = components["NodeView"]
    assert "transfer_failures" in node["required"]
    failures = node["properties"]["transfer_failures"]
    assert failures["items"] == {"$ref": "#/components/schemas/TransferFailure"}
    assert "at most 3" in failures["description"]
    entry = components["TransferFailure"]
    assert set(entry["required"]) == {
        "transfer_id",
        "sha256",
        "file_name",
        "error",
        "failed_at",
        "started_at",
        "bytes_done",
        "size_bytes",
        "sources",
    }
    assert {"type": "null"} in entry["properties"]["file_name"]["oneOf"]


def test_a_job_documents_its_route_and_cached_tokens(schema: dict[str, Any]) -> None:
    """The job view's prefix route and cached prompt tokens; the OpenAI usage's cached tokens."""
    components = schema["components"]["schemas"]
    job = components["JobView"]
    assert {"route", "cached_prompt_tokens"} <= set(job["required"])
    assert {"$ref": "#/components/schemas/JobRoute"} in job["properties"]["route"]["oneOf"]
    assert components["JobRoute"]["properties"]["prefix"]["enum"] == ["hit", "miss"]
    usage = components["Usage"]
    assert "prompt_tokens_details" in usage["required"]
    details = components["PromptTokensDetails"]
    assert details["properties"]["cached_tokens"] == {"type": "integer"}


def test_a_node_documents_its_devices_and_its_llama_cpp_build(schema: dict[str, Any]) -> None:
    components = schema["components"]["schemas"]
    node = components["NodeView"]
    assert {"devices", "llama"} <= set(node["required"])
    assert node["properties"]["devices"]["items"] == {"$ref": "#/components/schemas/NodeDevice"}
    device = components["NodeDevice"]
    assert set(device["required"]) == {
        "name",
        "description",
        "kind",
        "memory_total_bytes",
        "memory_free_bytes",
        "uuid",
    }
    assert set(device["properties"]["kind"]["enum"]) == {"gpu", "cpu"}
    assert set(components["NodeLlama"]["required"]) == {"version", "backend", "rpc_protocol"}
