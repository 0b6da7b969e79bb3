"""``/api/admin/jobs…`` and ``/api/admin/nodes/{id}/events`` over real Postgres and SQLite, and
what the HTTP API must check before anything reaches the store (found by fuzzing the schema,
tests/integration/test_api_fuzz.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from application.commands import ChatPrompt, JobOutcome, JobParams, Submission
from application.context_guard import ContextGuard
from application.enrollment import EnrollmentService
from application.timeline import job_timeline
from infrastructure.live_state import InProcessLiveState
from infrastructure.model_store import ControllerModelStore
from infrastructure.prompt_counter import GgufPromptCounter
from infrastructure.settings import Settings
from infrastructure.storage import Storage
from interfaces.grpc.grpc_server import AgentConnections
from interfaces.http.admin.admin_jobs_api import AdminJobRoutes
from interfaces.http.http_app import create_app
from interfaces.services import Services
from tests.integration.incident import Incident, script_incident
from tests.integration.store_builders import enroll_ready
from tests.plans import one_node_plan

ADMIN = {"Authorization": "Bearer test-admin-key"}


def services_for(storage: Storage, admin_key: str | None = "test-admin-key") -> Services:
    return Services(
        settings=Settings(admin_api_key=admin_key),
        app=storage.app,
        read_model=storage.read_model,
        follower=storage.follower,
        live=InProcessLiveState(),
        connections=AgentConnections(),
        enrollment=EnrollmentService(storage.app, None),
        context_guard=ContextGuard(
            GgufPromptCounter(ControllerModelStore(Settings().model_store_dir))
        ),
    )


def admin_app(services: Services) -> Litestar:
    """The HTTP app with the jobs routes (added here until ``create_app`` has them)."""
    app = create_app(services)
    if any(route.path == "/api/admin/jobs" for route in app.routes):
        return app
    return create_app(services, extra_handlers=[AdminJobRoutes])


@pytest.fixture
def incident(storage: Storage) -> Incident:
    return script_incident(storage)


@pytest.fixture
def client(storage: Storage, incident: Incident) -> Iterator[TestClient[Any]]:
    app = admin_app(services_for(storage))
    with TestClient(app) as c:
        yield c


def ids(body: dict[str, Any]) -> list[str]:
    return [row["job_id"] for row in body["data"]]


def test_list_filters(client: TestClient[Any], incident: Incident) -> None:
    body = client.get("/api/admin/jobs", headers=ADMIN).json()
    assert body["object"] == "list"
    assert (body["limit"], body["offset"], body["has_more"]) == (50, 0, False)
    all_jobs = {
        str(incident.completed_job),
        str(incident.setup_failed_job),
        str(incident.execution_failed_job),
    }
    assert set(ids(body)) == all_jobs
    assert ids(body)[0] == str(incident.execution_failed_job)  # newest first
    assert all("text" not in row and "timings" in row for row in body["data"])

    failed = client.get("/api/admin/jobs", params={"state": "failed"}, headers=ADMIN).json()
    assert set(ids(failed)) == {str(incident.setup_failed_job), str(incident.execution_failed_job)}
    done = client.get("/api/admin/jobs", params={"state": "COMPLETED"}, headers=ADMIN).json()
    assert ids(done) == [str(incident.completed_job)]
    on_a = client.get(
        "/api/admin/jobs", params={"node_id": str(incident.node_a)}, headers=ADMIN
    ).json()
    assert ids(on_a) == [str(incident.setup_failed_job)]
    on_b_failed = client.get(
        "/api/admin/jobs",
        params={"node_id": str(incident.node_b), "state": "FAILED"},
        headers=ADMIN,
    ).json()
    assert ids(on_b_failed) == [str(incident.execution_failed_job)]
    assert ids(client.get("/api/admin/jobs?model=smollm2", headers=ADMIN).json()) != []
    assert ids(client.get("/api/admin/jobs?model=other", headers=ADMIN).json()) == []


def test_a_job_shows_its_route_and_cached_prompt_tokens(
    storage: Storage, client: TestClient[Any], incident: Incident
) -> None:
    """A job dispatched to the server holding its prefix, which took 1,536 of its 1,600
    prompt tokens from its cache: in the list and in the job, as the dashboard reads them."""
    app = storage.app
    submitted = app.submit(
        Submission("smollm2", ChatPrompt([{"role": "user", "content": "again"}]), JobParams(), True)
    )
    job = submitted.aggregate_id
    assert job is not None
    route = {"prefix": "hit", "matched_chars": 6144}
    node = enroll_ready(app, "node-c")
    app.plan_and_dispatch(job, one_node_plan(node), {str(node): "primary"}, route=route)
    app.validate_setup(job)
    done = app.complete(job, JobOutcome("stop", 1600, 8, 12.5, 40.0, cached_prompt_tokens=1536))
    storage.follower.wait(done, timeout=10)
    one = client.get(f"/api/admin/jobs/{job}", headers=ADMIN).json()
    assert (one["route"], one["cached_prompt_tokens"]) == (route, 1536)
    listed = client.get("/api/admin/jobs", params={"state": "COMPLETED"}, headers=ADMIN).json()
    rows = {row["job_id"]: row for row in listed["data"]}
    assert (rows[str(job)]["route"], rows[str(job)]["cached_prompt_tokens"]) == (route, 1536)
    # Dispatched without a route (as before routing): none said.
    older = rows[str(incident.completed_job)]
    assert (older["route"], older["cached_prompt_tokens"]) == (None, 0)


def test_pagination(client: TestClient[Any]) -> None:
    everything = ids(client.get("/api/admin/jobs", headers=ADMIN).json())
    pages = []
    for offset in range(3):
        page = client.get(f"/api/admin/jobs?limit=1&offset={offset}", headers=ADMIN).json()
        assert (page["limit"], page["offset"]) == (1, offset)
        assert page["has_more"] is (offset < 2)
        pages.extend(ids(page))
    assert pages == everything
    beyond = client.get("/api/admin/jobs?limit=2&offset=3", headers=ADMIN).json()
    assert beyond["data"] == [] and beyond["has_more"] is False


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=0", "limit"),
        ("limit=201", "limit"),
        ("offset=-1", "offset"),
        ("limit=abc", "limit"),
        ("state=BOGUS", "state"),
        # These reached Postgres, which refused them: a "503 store busy, retry" (its error
        # text included) for a request that can never succeed.
        ("model=%00", "model"),
        ("node_id=%00", "node_id"),
        ("offset=99999999999999999999", "offset"),
        ("node_id=not-a-uuid", "node_id"),
        ("model=-not-a-model-name", "model"),
    ],
)
def test_bad_queries_are_400(client: TestClient[Any], query: str, param: str) -> None:
    response = client.get(f"/api/admin/jobs?{query}", headers=ADMIN)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_empty_filters_filter_nothing(client: TestClient[Any]) -> None:
    everything = ids(client.get("/api/admin/jobs", headers=ADMIN).json())
    empty = client.get("/api/admin/jobs?state=&model=&node_id=", headers=ADMIN)
    assert empty.status_code == 200 and ids(empty.json()) == everything


def test_one_job_with_plan_timings_and_failure(client: TestClient[Any], incident: Incident) -> None:
    failed = client.get(f"/api/admin/jobs/{incident.execution_failed_job}", headers=ADMIN).json()
    assert failed["state"] == "FAILED"
    assert failed["plan"]["primary"]["node_id"] == str(incident.node_b)
    assert failed["nodes"] == [str(incident.node_b)]
    assert failed["failure_phase"] == "execution"
    assert failed["failure"]["phase"] == "execution"
    assert "control stream closed" in failed["failure"]["reason"]
    assert failed["text"] == "Hello" and failed["tokens_streamed"] == 3
    assert failed["timings"]["setup_ms"] >= 0 and failed["timings"]["total_ms"] >= 0

    setup = client.get(f"/api/admin/jobs/{incident.setup_failed_job}", headers=ADMIN).json()
    assert setup["failure"]["phase"] == "setup" and setup["validated_at"] is None
    assert setup["timings"]["setup_ms"] is None

    done = client.get(f"/api/admin/jobs/{incident.completed_job}", headers=ADMIN).json()
    assert done["failure"] is None
    assert done["timings"]["time_to_first_token_ms"] == 12.5
    assert done["timings"]["tokens_per_second"] == 40.0
    assert done["time_to_first_token_ms"] == 12.5


def test_timelines_match_the_cli(
    client: TestClient[Any], storage: Storage, incident: Incident
) -> None:
    job = client.get(f"/api/admin/jobs/{incident.execution_failed_job}/events", headers=ADMIN)
    assert job.status_code == 200
    body = job.json()
    assert body["object"] == "list" and body["job_id"] == str(incident.execution_failed_job)
    assert body["data"] == job_timeline(storage.app, incident.execution_failed_job)
    assert body["data"][-1]["code"] == "JOB_FAILED"

    node = client.get(f"/api/admin/nodes/{incident.node_a}/events", headers=ADMIN).json()
    assert [e["code"] for e in node["data"]][-2:] == ["HEARTBEAT_TIMEOUT", "NODE_OFFLINE"]
    assert node["data"][-2]["summary"] == "no heartbeat for 7.0 s"


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/api/admin/jobs/{missing}", "job_not_found"),
        ("/api/admin/jobs/not-a-uuid", "job_not_found"),
        ("/api/admin/jobs/{missing}/events", "job_not_found"),
        ("/api/admin/jobs/{node}/events", "job_not_found"),
        ("/api/admin/nodes/{missing}/events", "node_not_found"),
        ("/api/admin/nodes/{job}/events", "node_not_found"),
        ("/api/admin/nodes/node-a/events", "node_not_found"),
    ],
)
def test_unknown_ids_are_404(
    client: TestClient[Any], incident: Incident, path: str, code: str
) -> None:
    url = path.format(missing=uuid.uuid4(), node=incident.node_a, job=incident.setup_failed_job)
    response = client.get(url, headers=ADMIN)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and error["code"] == code
    assert error["message"].startswith("unknown ")


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [
        ("GET", "/api/admin/nodes/%00", "node_not_found"),
        ("GET", "/api/admin/nodes/not-a-uuid", "node_not_found"),
        ("POST", "/api/admin/nodes/%00/drain", "node_not_found"),
        ("POST", "/api/admin/nodes/x%00y/resume", "node_not_found"),
        ("GET", "/api/admin/nodes/%00/events", "node_not_found"),
        ("GET", "/api/admin/jobs/%00", "job_not_found"),
        ("GET", "/api/admin/jobs/%00/events", "job_not_found"),
    ],
)
def test_ids_that_are_no_uuid_never_reach_the_store(
    client: TestClient[Any], method: str, path: str, code: str
) -> None:
    """A NUL byte in an id used to reach Postgres: 503 "store busy", with its error text."""
    response = client.request(method, path, headers=ADMIN)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == code
    assert "retry-after" not in response.headers


def test_an_id_in_capitals_names_the_same_job(client: TestClient[Any], incident: Incident) -> None:
    job = str(incident.completed_job).upper()
    one = client.get(f"/api/admin/jobs/{job}", headers=ADMIN)
    assert one.status_code == 200 and one.json()["job_id"] == str(incident.completed_job)


@pytest.mark.parametrize(
    ("registration", "param"),
    [
        # Python's "$" matches before a final newline: these were registered.
        ({"name": "m\n", "sha256": "ab" * 32}, None),
        ({"name": "m", "sha256": "ab" * 32 + "\n"}, None),
        ({"name": "m", "sha256": "ab" * 31}, "sha256"),
        ({"name": "m", "sha256": "ab" * 32, "context_size": 64}, "context_size"),
    ],
)
def test_model_registrations_are_checked_whole(
    client: TestClient[Any], registration: dict[str, Any], param: str | None
) -> None:
    response = client.post(
        "/api/admin/models", headers=ADMIN, json={"file_name": "m.gguf", **registration}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert client.get("/api/admin/models", headers=ADMIN).json()["data"] == []


def test_a_token_bound_to_an_empty_name_is_refused(client: TestClient[Any]) -> None:
    """``node_name: ""`` used to mint a token any agent could use."""
    response = client.post("/api/admin/enrollment-tokens", headers=ADMIN, json={"node_name": ""})
    assert response.status_code == 400 and response.json()["error"]["param"] == "node_name"


def test_a_model_name_no_model_can_have_is_not_looked_up(client: TestClient[Any]) -> None:
    """A NUL byte in a chat request's model reached Postgres: 503 instead of 404."""
    response = client.post(
        "/v1/chat/completions",
        json={"model": "m\x00", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"


class DownLiveState(InProcessLiveState):
    def ping(self) -> bool:
        return False


def test_every_503_says_when_to_retry(storage: Storage) -> None:
    """Parts not running (job manager, metrics, feed) and a degraded /health answer 503
    with Retry-After, as the schema documents for every 503."""
    storage.app.register_model("m", "ab" * 32, "m.gguf", 2048)
    storage.follower.wait(storage.app.position(), timeout=5)
    services = services_for(storage)
    services.live = DownLiveState()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(admin_app(services)) as c:
        answers = {
            "chat": c.post("/v1/chat/completions", json=chat),
            "metrics": c.get("/metrics"),
            "feed": c.get("/api/admin/events/stream", headers=ADMIN),
            "health": c.get("/health"),
        }
    for name, response in answers.items():
        assert response.status_code == 503, (name, response.text)
        assert int(response.headers["retry-after"]) > 0, name
    assert answers["health"].json()["status"] == "degraded"


@pytest.mark.parametrize(
    "path",
    [
        "/api/admin/jobs",
        "/api/admin/jobs/{job}",
        "/api/admin/jobs/{job}/events",
        "/api/admin/nodes/{node}/events",
    ],
)
def test_admin_key_required(
    client: TestClient[Any], storage: Storage, incident: Incident, path: str
) -> None:
    url = path.format(job=incident.completed_job, node=incident.node_b)
    assert client.get(url).status_code == 401
    wrong = client.get(url, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_api_key"
    disabled = admin_app(services_for(storage, admin_key=None))
    with TestClient(disabled) as c:
        off = c.get(url, headers=ADMIN)
    assert off.status_code == 403 and off.json()["error"]["code"] == "admin_disabled"
