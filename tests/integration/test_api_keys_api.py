"""Managed inference keys over real Postgres and SQLite: the admin API
(``/api/admin/api-keys``), the inference guard (``AI_API_KEY``, managed keys, an open cluster),
each key's model allow-list on ``/v1``, and a revocation seen at once by a second controller
sharing the Postgres store."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
from litestar.testing import TestClient

from application.commands import Submission
from domain.api_key import KEY_PREFIX
from domain.api_keys import BOOTSTRAP_KEY_ID, OPEN_KEY_ID, Priority
from infrastructure.settings import Settings
from infrastructure.storage import Storage, open_storage
from interfaces.http.http_app import create_app
from interfaces.http.http_errors import ApiError
from interfaces.services import Services
from tests.integration.test_admin_jobs_api import services_for

ADMIN = {"Authorization": "Bearer test-admin-key"}
AI_KEY = "test-ai-key"
SHA = "ab" * 32
NOT_THERE = "The model `{}` does not exist or you do not have access to it."


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class RecordingJobs:
    """Stands in for the job manager: keeps each submission, then answers 503."""

    def __init__(self) -> None:
        self.submissions: list[Submission] = []

    async def start(self, submission: Submission, model: dict[str, Any]) -> Any:
        self.submissions.append(submission)
        raise ApiError(503, "recorded", type_="server_error", headers={"Retry-After": "1"})


def client_for(services: Services) -> TestClient[Any]:
    return TestClient(create_app(services))


@pytest.fixture
def services(storage: Storage) -> Services:
    svc = services_for(storage)
    svc.settings = Settings(admin_api_key="test-admin-key", ai_api_key=AI_KEY)
    for name in ("m1", "m2", "e1"):
        kind = "embedding" if name.startswith("e") else "chat"
        storage.app.register_model(name, SHA, f"{name}.gguf", kind=kind)
    storage.follower.wait(storage.app.position())  # the views list them (read-your-writes)
    svc.jobs = RecordingJobs()  # type: ignore[assignment]
    return svc


@pytest.fixture
def client(services: Services) -> Iterator[TestClient[Any]]:
    with client_for(services) as c:
        yield c


def create(client: TestClient[Any], **body: Any) -> dict[str, Any]:
    answer = client.post("/api/admin/api-keys", json=body, headers=ADMIN)
    assert answer.status_code == 201, answer.text
    created: dict[str, Any] = answer.json()
    return created


# ---------------------------------------------------------------------- admin API


def test_create_with_a_name_only(client: TestClient[Any]) -> None:
    created = create(client, name="team a")
    assert created["key"].startswith(KEY_PREFIX + UUID(created["id"]).hex)
    assert created["models"] is None and created["priority"] == "interactive"
    assert created["limits"] == {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "concurrent_requests": None,
        "monthly_tokens": None,
    }
    assert (created["active"], created["revoked"], created["expires_at"]) == (True, False, None)
    shown = client.get(f"/api/admin/api-keys/{created['id']}", headers=ADMIN).json()
    assert "key" not in shown and "key_sha256" not in shown
    assert shown == {k: v for k, v in created.items() if k != "key"}
    listed = client.get("/api/admin/api-keys", headers=ADMIN).json()
    assert listed["object"] == "list" and [k["id"] for k in listed["data"]] == [created["id"]]
    assert created["key"] not in str(listed)


def test_create_with_every_term(client: TestClient[Any]) -> None:
    created = create(
        client,
        name="batch jobs",
        owner="ml team",
        models=["m1"],
        limits={"requests_per_minute": 60, "monthly_tokens": 1_000_000},
        priority="batch",
        expires_at="2099-01-01T00:00:00Z",
    )
    assert (created["owner"], created["models"], created["priority"]) == (
        "ml team",
        ["m1"],
        "batch",
    )
    assert created["limits"]["requests_per_minute"] == 60
    assert created["limits"]["tokens_per_minute"] is None
    assert datetime.fromisoformat(created["expires_at"]) == datetime(2099, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "   "}, "name"),
        ({"name": "a", "limits": {"requests_per_minute": 0}}, "requests_per_minute"),
        ({"name": "a", "models": []}, "models"),
        ({"name": "a", "models": ["no spaces"]}, "models"),
        ({"name": "a", "models": ["m1", "\u0012"]}, "models"),
        ({"name": "a", "priority": "urgent"}, "priority"),
        ({"name": "a", "expires_at": "2099-01-01T00:00:00"}, "expires_at"),
        ({"name": "a", "expires_at": "tomorrow"}, "expires_at"),
    ],
)
def test_bad_fields_are_400_with_their_param(
    client: TestClient[Any], body: dict[str, Any], param: str
) -> None:
    answer = client.post("/api/admin/api-keys", json=body, headers=ADMIN)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert param in str(error["param"]) or param in error["message"], error


def test_change_and_revoke(client: TestClient[Any]) -> None:
    created = create(client, name="a", models=["m1"])
    path = f"/api/admin/api-keys/{created['id']}"
    changed = client.patch(
        path,
        json={"name": "b", "models": None, "limits": {"concurrent_requests": 2}},
        headers=ADMIN,
    )
    assert changed.status_code == 200, changed.text
    body = changed.json()
    assert (body["name"], body["models"], body["limits"]["concurrent_requests"]) == ("b", None, 2)
    assert body["owner"] == "" and body["updated_at"] >= body["created_at"]
    same = client.patch(path, json={}, headers=ADMIN)
    assert same.status_code == 200 and same.json()["name"] == "b"

    revoked = client.post(f"{path}/revoke", json={"reason": "leaked"}, headers=ADMIN)
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["revoked"] is True and revoked.json()["active"] is False
    assert revoked.json()["revoke_reason"] == "leaked"
    assert revoked.json()["revoked_by"] == "admin-api"
    again = client.post(f"{path}/revoke", headers=ADMIN)
    assert again.status_code == 409 and again.json()["error"]["code"] == "illegal_transition"
    frozen = client.patch(path, json={"name": "c"}, headers=ADMIN)
    assert frozen.status_code == 409


@pytest.mark.parametrize("ident", ["00000000-0000-4000-8000-000000000000", "nope"])
def test_unknown_keys_are_404(client: TestClient[Any], ident: str) -> None:
    for answer in (
        client.get(f"/api/admin/api-keys/{ident}", headers=ADMIN),
        client.patch(f"/api/admin/api-keys/{ident}", json={"name": "x"}, headers=ADMIN),
        client.post(f"/api/admin/api-keys/{ident}/revoke", headers=ADMIN),
    ):
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == ("api_key_not_found", "not_found_error")


def test_a_job_id_is_no_key(client: TestClient[Any], storage: Storage) -> None:
    """A UUID of another aggregate (a model's) names no key."""
    model = storage.app.register_model("m3", SHA, "m3.gguf").aggregate_id
    assert client.get(f"/api/admin/api-keys/{model}", headers=ADMIN).status_code == 404
    answer = client.post(f"/api/admin/api-keys/{model}/revoke", headers=ADMIN)
    assert answer.status_code == 404


def test_the_admin_key_guards_the_routes(client: TestClient[Any]) -> None:
    assert client.get("/api/admin/api-keys").status_code == 401
    with_ai_key = client.post("/api/admin/api-keys", json={"name": "a"}, headers=bearer(AI_KEY))
    assert with_ai_key.status_code == 403


# ---------------------------------------------------------------- inference guard


def test_bootstrap_and_managed_keys(client: TestClient[Any], services: Services) -> None:
    created = create(client, name="team a", priority="batch")
    assert client.get("/v1/models", headers=bearer(AI_KEY)).status_code == 200
    assert client.get("/v1/models", headers=bearer(created["key"])).status_code == 200
    jobs: RecordingJobs = services.jobs  # type: ignore[assignment]
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    for key in (AI_KEY, created["key"]):
        answer = client.post("/v1/chat/completions", json=chat, headers=bearer(key))
        assert answer.status_code == 503 and answer.json()["error"]["message"] == "recorded"
    bootstrap, managed = (s.grant for s in jobs.submissions)
    assert bootstrap.key_id == BOOTSTRAP_KEY_ID
    assert (managed.key_id, managed.name, managed.priority) == (
        created["id"],
        "team a",
        Priority.BATCH,
    )


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        (bearer("wrong"), "invalid_api_key"),
        (bearer("test-admin-key"), "invalid_api_key"),
        (bearer(KEY_PREFIX + "0" * 32 + "x" * 43), "invalid_api_key"),
    ],
)
def test_wrong_keys_are_401(client: TestClient[Any], headers: dict[str, str], code: str) -> None:
    answer = client.get("/v1/models", headers=headers)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == code


def test_a_revoked_key_fails_at_once(client: TestClient[Any]) -> None:
    created = create(client, name="a")
    key = bearer(created["key"])
    assert client.get("/v1/models", headers=key).status_code == 200
    client.post(f"/api/admin/api-keys/{created['id']}/revoke", headers=ADMIN)
    answer = client.get("/v1/models", headers=key)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


def test_a_tampered_key_fails(client: TestClient[Any]) -> None:
    key = create(client, name="a")["key"]
    tampered = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert client.get("/v1/models", headers=bearer(tampered)).status_code == 401


def test_an_expired_key_fails(client: TestClient[Any]) -> None:
    soon = datetime.now(UTC) + timedelta(hours=1)
    created = create(client, name="a", expires_at=soon.isoformat())
    assert client.get("/v1/models", headers=bearer(created["key"])).status_code == 200
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    path = f"/api/admin/api-keys/{created['id']}"
    assert client.patch(path, json={"expires_at": past}, headers=ADMIN).json()["active"] is False
    assert client.get("/v1/models", headers=bearer(created["key"])).status_code == 401


def test_an_open_cluster_closes_while_a_managed_key_lives(storage: Storage) -> None:
    svc = services_for(storage)  # no AI_API_KEY
    with client_for(svc) as client:
        assert client.get("/v1/models").status_code == 200
        created = create(client, name="a")
        answer = client.get("/v1/models")
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "missing_api_key"
        assert client.get("/v1/models", headers=bearer("anything")).status_code == 401
        assert client.get("/v1/models", headers=bearer(created["key"])).status_code == 200
        client.post(f"/api/admin/api-keys/{created['id']}/revoke", headers=ADMIN)
        assert client.get("/v1/models").status_code == 200  # open again


def test_an_open_cluster_grants_open(storage: Storage) -> None:
    svc = services_for(storage)
    storage.app.register_model("m1", SHA, "m1.gguf")
    storage.follower.wait(storage.app.position())  # the views list it (read-your-writes)
    jobs = RecordingJobs()
    svc.jobs = jobs  # type: ignore[assignment]
    with client_for(svc) as client:
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=chat).status_code == 503
    assert jobs.submissions[0].grant.key_id == OPEN_KEY_ID


# ------------------------------------------------------------------ allow-list


def test_models_outside_the_allow_list_do_not_exist(
    client: TestClient[Any], services: Services
) -> None:
    key = bearer(create(client, name="a", models=["m1", "e1"])["key"])
    listed = client.get("/v1/models", headers=key).json()
    assert [card["id"] for card in listed["data"]] == ["e1", "m1"]
    everything = client.get("/v1/models", headers=bearer(AI_KEY)).json()
    assert sorted(card["id"] for card in everything["data"]) == ["e1", "m1", "m2"]
    assert client.get("/v1/models/m1", headers=key).status_code == 200
    hidden = client.get("/v1/models/m2", headers=key)
    unknown = client.get("/v1/models/zz", headers=key)
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.json()["error"]["message"] == NOT_THERE.format("m2")
    assert hidden.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"

    requests: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ]
    for path, body in requests:
        refused = client.post(path, json={**body, "model": "m2"}, headers=key)
        assert refused.status_code == 404, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert error["message"] == NOT_THERE.format("m2")
        allowed = client.post(path, json={**body, "model": "m1"}, headers=key)
        assert allowed.status_code == 503  # reached the (recording) job manager
    embedded = client.post("/v1/embeddings", json={"model": "e1", "input": "hi"}, headers=key)
    assert embedded.status_code == 503
    jobs: RecordingJobs = services.jobs  # type: ignore[assignment]
    assert {s.model for s in jobs.submissions} == {"m1", "e1"}
    assert all(s.grant.models == frozenset({"m1", "e1"}) for s in jobs.submissions)


# ------------------------------------------------------------ two controllers


def test_a_revocation_counts_at_once_on_another_controller(
    postgres_env: dict[str, str],
) -> None:
    """Controller B checks keys against the store both share: the key that A revoked fails
    on B at once, whatever B's projections have seen."""
    a, b = open_storage(postgres_env).start(), open_storage(postgres_env).start()
    try:
        settings = Settings(admin_api_key="test-admin-key", ai_api_key=AI_KEY)
        on_a = dataclasses.replace(services_for(a), settings=settings)
        on_b = dataclasses.replace(services_for(b), settings=settings)
        with client_for(on_a) as client_a, client_for(on_b) as client_b:
            created = create(client_a, name="shared")
            key = bearer(created["key"])
            assert client_b.get("/v1/models", headers=key).status_code == 200
            b.follower.stop()  # B's views stand still: the check does not read them
            client_a.post(f"/api/admin/api-keys/{created['id']}/revoke", headers=ADMIN)
            answer = client_b.get("/v1/models", headers=key)
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "invalid_api_key"
    finally:
        a.close()
        b.close()
