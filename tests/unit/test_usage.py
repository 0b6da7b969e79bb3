"""Usage per API key (issue 25) on SQLite views: what a query accepts, the sums by key, model
and day with each filter, ``dacp usage`` with no controller running, and the bounded labels of
the per-key counters on /metrics. The same on Postgres, through a controller running jobs on
FakeAgents, is in tests/integration/test_usage_flow.py."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from eventsourcing.persistence import Tracking
from hypothesis import given
from hypothesis import strategies as st

from application.usage import (
    DEFAULT_GROUP_BY,
    UsageQuery,
    UsageQueryError,
    parse_bound,
    usage_query,
    usage_report,
)
from domain.api_keys import BOOTSTRAP_KEY_ID
from domain.job import Job
from infrastructure.key_usage_metrics import MAX_KEY_LABELS, MAX_MODEL_LABELS, OTHER
from infrastructure.metrics import PrometheusMetrics
from infrastructure.read_model_store import ReadModelStore, open_read_model
from interfaces.cli import main as cli

UTC = dt.UTC
DAY1 = dt.datetime(2026, 3, 1, 10, 0, tzinfo=UTC)
DAY2 = dt.datetime(2026, 3, 2, 23, 59, 59, 500000, tzinfo=UTC)
DAY3 = dt.datetime(2026, 3, 3, 0, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Ended:
    """A job to record: its key, model, end time, tokens, and whether it completed."""

    key: str
    model: str
    at: dt.datetime
    prompt: int = 0
    completion: int = 0
    completed: bool = True


def job_events(job: Ended) -> list[Any]:
    """The job's events from JOB_SUBMITTED to its end, all stamped with its end time."""
    agg = Job.submit(
        job_id=uuid.uuid4(),
        model=job.model,
        params={},
        messages=None,
        prompt_sha256="0" * 64,
        message_count=1,
        stream=False,
        key_id=job.key,
    )
    agg.record_plan({})
    agg.dispatch(["node"])
    agg.validate_setup()
    if job.completed:
        agg.complete(
            finish_reason="stop",
            prompt_tokens=job.prompt,
            completion_tokens=job.completion,
            time_to_first_token_ms=1.0,
            tokens_per_second=1.0,
        )
    else:
        agg.fail("node lost")
    events = list(agg.collect_events())
    for event in events:
        object.__setattr__(event, "timestamp", job.at)
    return events


class Views:
    """SQLite views fed with jobs' events, as the projection follower feeds them."""

    def __init__(self, store: ReadModelStore) -> None:
        self.store = store
        self.position = 0

    def record(self, *jobs: Ended) -> None:
        items = []
        for job in jobs:
            for event in job_events(job):
                self.position += 1
                items.append((event, Tracking(self.store.view_name, self.position)))
        self.store.process_events(items)


JOBS = (
    Ended("k1", "m", DAY1, 10, 5),
    Ended("k1", "m", DAY2, 20, 7),
    Ended("k1", "e", DAY2, 3, 0),
    Ended("k2", "m", DAY2, 100, 50),
    Ended("k2", "m", DAY3, 1, 1),
    Ended("k2", "m", DAY3, completed=False),  # a request, no tokens
    Ended("", "m", DAY1, 2, 2),  # recorded before keys
)


@pytest.fixture
def views(sqlite_env: dict[str, str]) -> Iterator[Views]:
    store = open_read_model(sqlite_env)
    out = Views(store)
    out.record(*JOBS)
    yield out
    factory = getattr(store, "factory", None)
    if factory is not None:
        factory.close()


def report(views: Views, **filters: str | None) -> dict[str, Any]:
    return usage_report(views.store, usage_query(**filters))


def rows(answer: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (
            r["key_id"],
            r["model"],
            r["day"],
            r["requests"],
            r["prompt_tokens"],
            r["completion_tokens"],
        )
        for r in answer["data"]
    ]


# ---------------------------------------------------------------------- queries


def test_a_query_names_the_parameter_it_cannot_use() -> None:
    for filters, param in (
        ({"key": "a b"}, "key"),
        ({"key": "k" * 129}, "key"),
        ({"model": "no/such model"}, "model"),
        ({"start": "yesterday"}, "from"),
        ({"end": "2026-13-01"}, "to"),
        ({"end": ""}, "to"),
        ({"group_by": "key,week"}, "group_by"),
    ):
        with pytest.raises(UsageQueryError) as refused:
            usage_query(**filters)
        assert refused.value.param == param, filters
    # a range that ends before it starts holds no jobs: not an error
    empty = usage_query(start="2026-03-02", end="2026-03-01")
    assert empty.start is not None and empty.end is not None and empty.end <= empty.start


def test_dates_and_times_are_utc_and_a_date_as_the_end_includes_its_day() -> None:
    assert parse_bound("2026-03-02", "from", end=False) == dt.datetime(2026, 3, 2, tzinfo=UTC)
    assert parse_bound("2026-03-02", "to", end=True) == dt.datetime(2026, 3, 3, tzinfo=UTC)
    assert parse_bound("2026-03-02T12:00:00Z", "to", end=True) == dt.datetime(
        2026, 3, 2, 12, tzinfo=UTC
    )
    assert parse_bound("2026-03-02T12:00:00+02:00", "from", end=False) == dt.datetime(
        2026, 3, 2, 10, tzinfo=UTC
    )
    assert parse_bound("2026-03-02T12:00", "from", end=False).tzinfo == UTC
    query = usage_query(group_by=" Day , key,day")
    assert query.group_by == ("key", "day")
    assert usage_query().group_by == DEFAULT_GROUP_BY
    assert usage_query(group_by="").group_by == ()


# ------------------------------------------------------------------------- sums


def test_totals_are_the_sums_of_the_jobs(views: Views) -> None:
    answer = report(views)
    totals = answer["totals"]
    assert totals == {
        "requests": len(JOBS),
        "prompt_tokens": sum(j.prompt for j in JOBS),
        "completion_tokens": sum(j.completion for j in JOBS),
        "total_tokens": sum(j.prompt + j.completion for j in JOBS),
    }
    assert rows(answer) == [
        ("", "m", None, 1, 2, 2),
        ("k1", "e", None, 1, 3, 0),
        ("k1", "m", None, 2, 30, 12),
        ("k2", "m", None, 3, 101, 51),
    ]
    assert all(
        r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"] for r in answer["data"]
    )
    assert report(views, group_by="")["data"] == [
        {"key_id": None, "key_name": None, "model": None, "day": None, **totals}
    ]


def test_grouping_by_day_and_by_key(views: Views) -> None:
    assert rows(report(views, group_by="day")) == [
        (None, None, "2026-03-01", 2, 12, 7),
        (None, None, "2026-03-02", 3, 123, 57),
        (None, None, "2026-03-03", 2, 1, 1),
    ]
    assert rows(report(views, group_by="key,model,day", key="k2")) == [
        ("k2", "m", "2026-03-02", 1, 100, 50),
        ("k2", "m", "2026-03-03", 2, 1, 1),
    ]
    by_key = report(views, group_by="key")
    assert [(r["key_id"], r["requests"]) for r in by_key["data"]] == [("", 1), ("k1", 3), ("k2", 3)]


def test_filters_by_key_model_and_end_time(views: Views) -> None:
    assert report(views, key="k1", model="m")["totals"]["requests"] == 2
    assert report(views, model="e")["totals"]["prompt_tokens"] == 3
    assert report(views, key="nobody")["data"] == []
    assert report(views, key="nobody")["totals"]["requests"] == 0
    # A date as the end takes in its whole day, to its last microsecond.
    assert report(views, end="2026-03-02", group_by="")["totals"]["requests"] == 5
    assert report(views, start="2026-03-02", end="2026-03-02", group_by="")["totals"] == {
        "requests": 3,
        "prompt_tokens": 123,
        "completion_tokens": 57,
        "total_tokens": 180,
    }
    # A time as the end leaves it out; as the start, takes it in.
    at = "2026-03-02T23:59:59.5Z"
    assert report(views, end=at, group_by="")["totals"]["requests"] == 2
    assert report(views, start=at, group_by="")["totals"]["requests"] == 5
    answer = report(views, start="2026-03-03T01:00:00+01:00")
    assert answer["filters"]["from"] == "2026-03-03T00:00:00Z"
    assert answer["totals"]["requests"] == 2


def test_running_jobs_are_not_counted_yet(views: Views) -> None:
    before = report(views, group_by="")["totals"]
    running = Job.submit(
        job_id=uuid.uuid4(),
        model="m",
        params={},
        messages=None,
        prompt_sha256="0" * 64,
        message_count=1,
        stream=True,
        key_id="k1",
    )
    views.position += 1
    [submitted] = running.collect_events()
    views.store.process_event(submitted, Tracking(views.store.view_name, views.position))
    assert report(views, group_by="")["totals"] == before
    row = views.store.get_job(str(running.id))
    assert row is not None and row["key_id"] == "k1"


def test_key_names_where_they_are_known(views: Views) -> None:
    views.record(Ended(BOOTSTRAP_KEY_ID, "m", DAY1, 1, 1))
    data = report(views, group_by="key")["data"]
    named = {r["key_id"]: r.get("key_name") for r in data}
    assert named[BOOTSTRAP_KEY_ID] == "AI_API_KEY"
    assert named["k1"] is None and all("key_name" in r for r in data)  # null, not left out
    # A managed key's name comes from the key book's view (api_keys), as that view has it.
    with views.store.datastore.transaction(commit=True) as c:
        c.execute(
            "CREATE TABLE IF NOT EXISTS dacp_readmodel_api_keys "
            "(key_id TEXT PRIMARY KEY, created_at TEXT NOT NULL, data TEXT NOT NULL)"
        )
        c.execute(
            "INSERT INTO dacp_readmodel_api_keys VALUES (?, ?, ?)",
            ("k2", DAY1.isoformat(), json.dumps({"id": "k2", "name": "team-a"})),
        )
    named = {r["key_id"]: r.get("key_name") for r in report(views, group_by="key")["data"]}
    assert named == {"": None, BOOTSTRAP_KEY_ID: "AI_API_KEY", "k1": None, "k2": "team-a"}
    assert all(r["key_name"] is None for r in report(views, group_by="model")["data"])


# -------------------------------------------------------------------------- CLI


def test_dacp_usage_reads_the_store_with_no_controller(
    views: Views, sqlite_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{sqlite_env['SQLITE_DBNAME']}"
    capsys.readouterr()
    assert cli.main(["usage", "--database-url", url, "--by", "key,day", "--key", "k2"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == [
        "KEY", "NAME", "DAY", "(UTC)", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL"
    ]  # fmt: skip
    assert [line.split() for line in lines[1:]] == [
        ["k2", "2026-03-02", "1", "100", "50", "150"],
        ["k2", "2026-03-03", "2", "1", "1", "2"],
        ["TOTAL", "3", "101", "51", "152"],
    ]
    assert err.startswith("dacp: used the event store sqlite:///") and "(--database-url)" in err

    assert cli.main(["usage", "--database-url", url, "--json", "--model", "e"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["totals"]["prompt_tokens"] == 3 and answer["group_by"] == ["key", "model"]

    assert cli.main(["usage", "--database-url", url, "--from", "soon"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("dacp: --from: ")


def test_dacp_usage_with_no_store_says_so(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DACP_VAR_DIR", str(tmp_path / "nothing"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert cli.main(["usage"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("dacp: no event store at ") and len(err.splitlines()) == 1
    assert not (tmp_path / "nothing").exists()


# ---------------------------------------------------------------------- metrics


def sample(metrics: PrometheusMetrics, name: str, key: str, model: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"key": key, "model": model})


def feed(metrics: PrometheusMetrics, *jobs: Ended) -> None:
    position = 0
    for job in jobs:
        for event in job_events(job):
            position += 1
            metrics.on_event(position, event)


def test_per_key_counters_count_requests_and_completed_tokens() -> None:
    metrics = PrometheusMetrics()
    feed(metrics, *JOBS)
    assert sample(metrics, "dacp_key_requests_total", "k2", "m") == 3
    assert sample(metrics, "dacp_key_prompt_tokens_total", "k2", "m") == 101
    assert sample(metrics, "dacp_key_completion_tokens_total", "k1", "m") == 12
    assert sample(metrics, "dacp_key_requests_total", "none", "m") == 1
    text = metrics.exposition().decode()
    assert 'dacp_key_requests_total{key="k1",model="e"} 1.0' in text


@given(
    keys=st.lists(st.text("abcdefghij", min_size=1, max_size=3), min_size=1, max_size=150),
    models=st.lists(st.sampled_from([f"m{i}" for i in range(70)]), min_size=1, max_size=150),
)
def test_per_key_labels_stay_bounded_and_nothing_is_lost(
    keys: list[str], models: list[str]
) -> None:
    """At most MAX_KEY_LABELS keys and MAX_MODEL_LABELS models get labels of their own, the
    first seen; the rest count as OTHER; the sums over all labels are the jobs'."""
    metrics = PrometheusMetrics()
    jobs = [Ended(k, m, DAY1, 2, 3) for k, m in zip(keys, models, strict=False)]
    feed(metrics, *jobs)
    samples = [
        s
        for family in metrics.registry.collect()
        if family.name == "dacp_key_prompt_tokens"
        for s in family.samples
        if s.name.endswith("_total")
    ]
    key_labels = {s.labels["key"] for s in samples}
    model_labels = {s.labels["model"] for s in samples}
    assert len(key_labels - {OTHER}) <= MAX_KEY_LABELS
    assert len(model_labels - {OTHER}) <= MAX_MODEL_LABELS
    first_keys = list(dict.fromkeys(j.key for j in jobs))[:MAX_KEY_LABELS]
    assert key_labels - {OTHER} == set(first_keys) - {OTHER}
    assert sum(s.value for s in samples) == 2 * len(jobs)


def test_a_job_submitted_before_the_controller_started_counts_no_tokens() -> None:
    metrics = PrometheusMetrics()
    events = job_events(Ended("k1", "m", DAY1, 5, 5))
    metrics.count_after(len(events) - 1)  # all but its completion are history
    for position, event in enumerate(events, start=1):
        metrics.on_event(position, event)
    assert sample(metrics, "dacp_key_requests_total", "k1", "m") is None
    assert sample(metrics, "dacp_key_prompt_tokens_total", "k1", "m") is None


def test_an_empty_query_is_every_ended_job() -> None:
    assert UsageQuery() == usage_query(group_by="key,model")
