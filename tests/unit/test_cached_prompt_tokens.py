"""The prompt tokens llama-server took from its cache, from the agent's JobResult to the job's
record, its view, the client's outcome and /metrics; and the prefix routes counted by result.

On the in-memory store with a fake agent gateway (tests/unit/job_cluster.py); the agent's side
(reading them from llama-server's final chunk) is in tests/unit/test_agent_llama_handler_logic.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

from eventsourcing.persistence import StoredEvent

from application.agent_messages import AgentJobResult, JobFinished
from application.commands import ChatPrompt, JobOutcome, JobParams, Submission
from application.read_models import project_job
from domain.catalog import code_of
from domain.job import Job
from infrastructure.metrics import PrometheusMetrics
from tests.unit.job_cluster import GUARD, Cluster

SYSTEM = "You read logs for a living and answer in one line. " * 40  # about 2 KB


def long_chat() -> Submission:
    prompt = ChatPrompt(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What failed?"}]
    )
    return Submission("m", prompt, JobParams(max_tokens=4), True)


async def run_one(cluster: Cluster, cached: int) -> tuple[str, JobOutcome]:
    """One long chat placed, validated and finished with ``cached`` of its 600 prompt tokens
    from the cache; its id and the outcome its client got."""
    before = len(cluster.gateway.primaries)
    task = asyncio.create_task(cluster.jobs.start(long_chat(), cluster.model))
    node, job = (await cluster.primary_assigned(before + 1))[-1]
    await cluster.validate(node, job)
    run = await asyncio.wait_for(task, GUARD)
    result = AgentJobResult(
        ok=True,
        finish_reason="stop",
        prompt_tokens=600,
        completion_tokens=2,
        cached_prompt_tokens=cached,
    )
    await cluster.jobs.handle(node, JobFinished(job, result))
    await cluster.jobs.settle()
    item = await asyncio.wait_for(run.queue.get(), GUARD)
    while item.kind == "deltas":
        item = await asyncio.wait_for(run.queue.get(), GUARD)
    assert item.kind == "done" and item.outcome is not None
    return job, item.outcome


def sample(metrics: PrometheusMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_cached_tokens_are_relayed_recorded_shown_and_counted() -> None:
    metrics = PrometheusMetrics()
    cluster = Cluster(1, metrics=metrics)
    first, first_outcome = await run_one(cluster, cached=0)
    second, second_outcome = await run_one(cluster, cached=512)
    assert (first_outcome.cached_prompt_tokens, second_outcome.cached_prompt_tokens) == (0, 512)

    [completed] = [e for e in cluster._events(second) if code_of(e) == "JOB_COMPLETED"]
    assert isinstance(completed, Job.Completed) and completed.cached_prompt_tokens == 512
    cluster.read.catch_up()
    rows = cluster.read.jobs
    assert rows[first]["route"] == {"prefix": "miss", "matched_chars": 0}
    assert rows[second]["route"]["prefix"] == "hit"
    assert rows[second]["route"]["matched_chars"] >= len(SYSTEM) // 256 * 256
    assert (rows[first]["cached_prompt_tokens"], rows[second]["cached_prompt_tokens"]) == (0, 512)

    assert sample(metrics, "dacp_prefix_routes_total", result="miss") == 1
    assert sample(metrics, "dacp_prefix_routes_total", result="hit") == 1
    assert sample(metrics, "dacp_prompt_tokens_total") == 1200
    assert sample(metrics, "dacp_cached_prompt_tokens_total") == 512


def test_route_labels_stay_bounded_and_the_cache_never_exceeds_the_prompt() -> None:
    metrics = PrometheusMetrics()
    for result in ("hit", "miss", "hit", "something else", "None"):
        metrics.count_prefix_route(result)
    assert sample(metrics, "dacp_prefix_routes_total", result="hit") == 2
    assert sample(metrics, "dacp_prefix_routes_total", result="miss") == 1
    assert sample(metrics, "dacp_prefix_routes_total", result="something else") is None
    metrics.count_prompt_tokens(100, 250)  # a count that makes no sense is capped
    metrics.count_prompt_tokens(40, -3)
    assert sample(metrics, "dacp_prompt_tokens_total") == 140
    assert sample(metrics, "dacp_cached_prompt_tokens_total") == 100
    exposition = metrics.exposition().decode()
    assert 'dacp_prefix_routes_total{result="hit"} 2.0' in exposition


async def test_a_completion_recorded_before_the_field_loads_with_none_cached() -> None:
    cluster = Cluster(1)
    job, _ = await run_one(cluster, cached=64)
    mapper = cluster.app.mapper
    [stored] = [
        s
        for s in (mapper.to_stored_event(e) for e in cluster._events(job))
        if s.topic.endswith("Completed")
    ]
    state: dict[str, Any] = mapper.transcoder.decode(stored.state)
    assert state.pop("cached_prompt_tokens") == 64
    old = StoredEvent(
        stored.originator_id,
        stored.originator_version,
        stored.topic,
        mapper.transcoder.encode(state),
    )
    event = mapper.to_domain_event(old)
    assert isinstance(event, Job.Completed) and event.cached_prompt_tokens == 0
    cluster.read.catch_up()
    row = project_job(dict(cluster.read.jobs[job]), event)
    assert row is not None and row["cached_prompt_tokens"] == 0
