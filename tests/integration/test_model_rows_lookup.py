"""An inference request finds its model in the rows held in memory (``Services.model_rows``,
kept by the projection follower), not in the views: no thread hop and no query on the first
token's path. Real store (Postgres and SQLite)."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from infrastructure.storage import Storage
from interfaces.http.http_app import create_app
from tests.integration.test_admin_jobs_api import services_for


class FakeModelRows:
    """Model rows by name, as :class:`infrastructure.node_rows.NodeRows` holds them."""

    def __init__(self, *rows: dict[str, Any]) -> None:
        self.rows = {row["name"]: row for row in rows}
        self.asked: list[str] = []

    def get_model(self, name: str) -> dict[str, Any] | None:
        self.asked.append(name)
        return self.rows.get(name)


ROW = {"name": "held", "sha256": "ab" * 32, "file_name": "h.gguf", "context_size": 512}


def _ask(client: TestClient[Any], model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return client.post("/v1/chat/completions", json=body)


def test_the_model_comes_from_the_rows_in_memory(storage: Storage) -> None:
    services = services_for(storage)
    services.model_rows = rows = FakeModelRows(ROW)
    with TestClient(create_app(services)) as client:
        found = _ask(client, "held")
        # Past the model's lookup, the app (built without a job manager) answers 503.
        assert found.status_code == 503, found.text
        assert "job manager is not running" in found.json()["error"]["message"]
        missing = _ask(client, "elsewhere")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert rows.asked == ["held", "elsewhere"]


def test_without_rows_in_memory_the_views_answer(storage: Storage) -> None:
    storage.app.register_model("viewed", "cd" * 32, "v.gguf", 512)
    storage.follower.wait(storage.app.position())
    with TestClient(create_app(services_for(storage))) as client:
        found = _ask(client, "viewed")
    assert found.status_code == 503, found.text
