"""The job manager's parts share one registry of runs and one set of settings: the façade's
``runs`` is the registry's dictionary, and a setting changed on the façade is the one every
part reads next."""

from __future__ import annotations

import asyncio
from typing import Any

from application.agent_messages import SetupOutcome
from application.commands import ChatPrompt, Submission
from application.deadlines import Deadlines
from application.job_registry import RunRegistry
from application.job_run import JobRun
from tests.unit.job_cluster import Cluster

MODEL: dict[str, Any] = {"name": "m"}


def _run(job_id: str, nodes: set[str], **fields: object) -> JobRun:
    run = JobRun(job_id, Submission("m", ChatPrompt([])), MODEL, nodes=nodes)
    for name, value in fields.items():
        setattr(run, name, value)
    return run


async def test_lookups_by_phase_and_node() -> None:
    registry = RunRegistry()
    queued = _run("q", set())
    setting_up = _run("s", {"a", "b"}, primary="a")
    executing = _run("e", {"a"}, primary="a", phase="execution", executing_since=1.0)
    validated = _run("v", {"b"}, primary="b")
    validated.setup_future = asyncio.get_running_loop().create_future()
    validated.setup_future.set_result(SetupOutcome(ok=True))
    for run in (queued, setting_up, executing, validated):
        registry.add(run)

    assert "q" in registry and "x" not in registry
    assert registry.get("s") is setting_up and registry.get("x") is None
    assert [r.job_id for r in registry.executing()] == ["e"]
    assert [r.job_id for r in registry.executing_on("a")] == ["e"]
    assert [r.job_id for r in registry.executing_on("b")] == ["v"]
    assert [r.job_id for r in registry.in_setup_on("b")] == ["s"]
    assert registry.holds(queued)
    assert registry.pop("q") is queued and registry.pop("q") is None
    assert not registry.holds(queued)
    assert [r.job_id for r in registry.all()] == ["s", "e", "v"]


async def test_the_facade_shares_its_runs_and_settings_with_its_parts() -> None:
    cluster = Cluster(1)
    jobs = cluster.jobs
    assert jobs.runs is jobs.registry.runs
    deadlines = Deadlines(first_token=1.0)
    jobs.deadlines = deadlines
    jobs.clock = lambda: 42.0
    assert jobs.settings.deadlines is deadlines and jobs.settings.clock() == 42.0
    assert jobs.deadlines is deadlines and jobs.clock() == 42.0
