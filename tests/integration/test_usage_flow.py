"""Usage per API key (issue 25) over real stores: jobs run by a controller on real Postgres
with FakeAgents under several key ids sum to the usage report, through the admin API, through
``dacp usage`` while no controller runs, and after a restart; ``GET /api/admin/usage`` refuses
bad filters naming them; views made before usage accounting get its columns (Postgres and
SQLite). The sums, filters and groups themselves are in tests/unit/test_usage.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from application.commands import ChatPrompt, Submission
from domain.api_keys import BOOTSTRAP_KEY_ID, Grant
from infrastructure.read_model_store import USAGE_COLUMNS, open_read_model
from infrastructure.storage import Storage
from interfaces.cli import main as cli
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.integration.incident import database_url
from tests.integration.test_admin_jobs_api import admin_app, services_for
from tests.integration.test_control_plane import wait_for
from tests.integration.test_job_flow import SHA, agents, http, register

ADMIN = {"Authorization": "Bearer test-admin-key"}

#: The jobs run: key id, the prompt tokens and the words the FakeAgent answers with.
RUNS = (
    ("team-a", 11, 3),
    ("team-a", 5, 2),
    ("team-b", 40, 1),
    ("team-c", 9, 4),
    ("team-b", 2, 2),
    (BOOTSTRAP_KEY_ID, 6, 2),
)


async def run_job(ctl: RunningController, key: str) -> str:
    """One chat job through the job manager under ``key``, to its end; its id."""
    jobs = ctl.services.jobs
    model = ctl.services.read_model.get_model("m")
    assert jobs is not None and model is not None
    prompt = ChatPrompt([{"role": "user", "content": "x"}])
    run = await jobs.start(Submission("m", prompt, grant=Grant(key_id=key, name=key)), model)
    while (await run.queue.get()).kind == "deltas":
        pass
    return str(run.job_id)


def sums(rows: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """Requests, prompt and completion tokens by key id, from the jobs' own rows."""
    out: dict[str, tuple[int, int, int]] = {}
    for row in rows:
        n, p, c = out.get(row["key_id"], (0, 0, 0))
        out[row["key_id"]] = (n + 1, p + row["prompt_tokens"], c + row["completion_tokens"])
    return out


def by_key(report: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    return {
        r["key_id"]: (r["requests"], r["prompt_tokens"], r["completion_tokens"])
        for r in report["data"]
    }


async def test_usage_is_the_sum_of_the_jobs_tokens_before_and_after_a_restart(
    pg_schema: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = controller_settings(pg_schema, tmp_path)
    async with controller(settings) as ctl:
        (agent,) = await agents(ctl, {"name": "a", "holds": SHA, "memory": 4 << 30})
        async with http(ctl) as client:
            await register(ctl, client)
            ids = []
            for key, prompt, words in RUNS:
                agent.prompt_tokens, agent.words = prompt, tuple(f" w{i}" for i in range(words))
                ids.append(await run_job(ctl, key))
            views = ctl.services.read_model
            await wait_for(
                lambda: (
                    sum(r["state"] == "COMPLETED" for r in views.list_jobs(limit=100)) == len(RUNS)
                )
            )
            rows = [r for r in views.list_jobs(limit=100) if r["state"] == "COMPLETED"]
            assert {r["job_id"] for r in rows} >= set(ids)
            expected = sums(rows)
            assert expected[BOOTSTRAP_KEY_ID] == (1, 6, 2)
            assert expected["team-b"] == (2, 42, 3)
            live = (await client.get("/api/admin/usage?group_by=key", headers=ADMIN)).json()
            assert by_key(live) == expected
            assert live["totals"]["total_tokens"] == sum(p + c for _, p, c in expected.values())
            names = {r["key_id"]: r.get("key_name") for r in live["data"]}
            assert names[BOOTSTRAP_KEY_ID] == "AI_API_KEY"
            metrics = (await client.get("/metrics")).text
            assert 'dacp_key_prompt_tokens_total{key="team-b",model="m"} 42.0' in metrics
        await agent.stop()

    # No controller runs: dacp reads the views in the store.
    url = settings.database_url
    assert url is not None
    capsys.readouterr()
    assert cli.main(["usage", "--by", "key", "--json", "--database-url", url]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert by_key(offline) == expected and offline["totals"] == live["totals"]

    async with controller(settings) as again, http(again) as client:
        after = (await client.get("/api/admin/usage?group_by=key", headers=ADMIN)).json()
        assert after["data"] == live["data"] and after["totals"] == live["totals"]
        one = await client.get(
            "/api/admin/usage", params={"key": "team-a", "group_by": "model,day"}, headers=ADMIN
        )
        [row] = one.json()["data"]
        assert (row["key_id"], row["model"], row["requests"]) == (None, "m", 2)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (16, 5)


# ------------------------------------------------------------------- the route


@pytest.fixture
def client(storage: Storage) -> Iterator[TestClient[Any]]:
    with TestClient(app=admin_app(services_for(storage))) as c:
        yield c


def test_bad_filters_are_refused_with_the_parameter_named(client: TestClient[Any]) -> None:
    for query, param in (
        ({"from": "last week"}, "from"),
        ({"to": "2026-02-30"}, "to"),
        ({"from": ""}, "from"),
        ({"group_by": "key,hour"}, "group_by"),
        ({"model": "a model"}, "model"),
        ({"key": "x" * 200}, "key"),
    ):
        answer = client.get("/api/admin/usage", params=query, headers=ADMIN)
        assert answer.status_code == 400, (query, answer.text)
        error = answer.json()["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error"), query
    assert client.get("/api/admin/usage").status_code == 401


def test_an_empty_store_answers_zero_and_the_route_is_documented(
    client: TestClient[Any],
) -> None:
    answer = client.get("/api/admin/usage", params={"from": "2026-01-01"}, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["data"] == [] and body["group_by"] == ["key", "model"]
    assert body["totals"] == {
        "requests": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
    }
    assert body["filters"] == {
        "key": None,
        "model": None,
        "from": "2026-01-01T00:00:00Z",
        "to": None,
    }
    doc = client.get("/schema/openapi.json").json()
    operation = doc["paths"]["/api/admin/usage"]["get"]
    assert {p["name"] for p in operation["parameters"]} == {
        "key",
        "model",
        "from",
        "to",
        "group_by",
    }
    assert {"200", "400", "401", "403"} <= set(operation["responses"])
    assert operation["security"] == [{"BearerAuth": []}]


# --------------------------------------------------------------- the migration


def test_views_made_before_usage_get_its_columns_filled(store_env: dict[str, str]) -> None:
    """A ``jobs`` view of the earlier shape: opening it adds the usage columns, filled from
    each row's data, so the usage report counts the jobs recorded before."""
    view = f"old_{uuid.uuid4().hex[:8]}"
    ended = {
        "job_id": "j1",
        "state": "COMPLETED",
        "model": "m",
        "submitted_at": "2026-03-01T10:00:00+00:00",
        "ended_at": "2026-03-01T10:00:01+00:00",
        "prompt_tokens": 12,
        "completion_tokens": 3,
    }  # no key_id: recorded before keys
    running = {**ended, "job_id": "j2", "state": "RUNNING", "ended_at": None, "key_id": "k"}
    running.update(prompt_tokens=None, completion_tokens=None)
    first = open_read_model(store_env, view_name=view)
    try:
        table = first._t("jobs")
        with first.datastore.transaction(commit=True) as c:  # the shape before usage
            c.execute(f"DROP TABLE {table}")
            c.execute(
                f"CREATE TABLE {table} (job_id TEXT PRIMARY KEY, state TEXT NOT NULL, "
                "model TEXT NOT NULL, submitted_at TEXT NOT NULL, data TEXT NOT NULL)"
            )
            for row in (ended, running):
                c.execute(
                    first._sql(f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?)"),
                    (row["job_id"], row["state"], "m", row["submitted_at"], json.dumps(row)),
                )
    finally:
        first.factory.close()  # type: ignore[union-attr]
    views = open_read_model(store_env, view_name=view)
    again = open_read_model(store_env, view_name=view)  # a second open changes nothing
    try:
        with views.datastore.transaction(commit=False) as c:
            assert {name for name, _ in USAGE_COLUMNS} <= views._columns(c, "jobs")
        from application.usage import usage_query, usage_report

        report = usage_report(views, usage_query(group_by="key"))
        assert [(r["key_id"], r["requests"], r["prompt_tokens"]) for r in report["data"]] == [
            ("", 1, 12)
        ]
        assert usage_report(again, usage_query())["totals"] == report["totals"]
    finally:
        views.factory.close()  # type: ignore[union-attr]
        again.factory.close()  # type: ignore[union-attr]


def test_the_cli_and_the_route_read_the_same_store(
    storage: Storage, client: TestClient[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    code = cli.main(["usage", "--json", "--database-url", database_url(storage.env)])
    assert code == 0
    assert (
        json.loads(capsys.readouterr().out) == client.get("/api/admin/usage", headers=ADMIN).json()
    )
