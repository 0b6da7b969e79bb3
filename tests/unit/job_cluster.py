"""A controller, scheduler and job manager on an in-memory store with a fake agent gateway.

Shared by the job manager's unit tests: no sleeps and no wall-clock windows; they wait for
recorded events and gateway calls, with a timeout only as a guard against hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from uuid import UUID

from application.admission import AdmissionQueue
from application.agent_messages import AgentJobResult, JobFinished, SetupOutcome, SetupReported
from application.commands import ChatPrompt, JobParams, Submission
from application.controller import Controller
from application.job_manager import JobManager
from application.job_run import JobRun
from application.ports import Metrics, ModelFetcher
from application.scheduler import Scheduler, SchedulerConfig
from application.token_recorder import TokenChunkRecorder
from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.catalog import code_of
from domain.model_claims import STORE, ByteRange, Samples, facts_of
from infrastructure.live_state import InProcessLiveState
from tests.enrollments import ready_node
from tests.unit.fakes import FakeAgentGateway, FakeReadModel

GIB = 1 << 30
MODEL: dict[str, Any] = {
    "name": "m",
    "sha256": "a" * 64,
    "file_name": "m.gguf",
    "context_size": 2048,
}
GUARD = 10.0  # seconds; only ever reached when a test is about to fail


def submission(text: str = "hi") -> Submission:
    return Submission(
        "m", ChatPrompt([{"role": "user", "content": text}]), JobParams(max_tokens=4), True
    )


class Cluster:
    """A controller with ``nodes`` nodes (single-slot unless ``slots``) that hold the model."""

    def __init__(
        self,
        nodes: int,
        *,
        queue_max: int = 512,
        queue_timeout: float = 60.0,
        slots: int = 1,
        ram: int = 8 * GIB,
        metrics: Metrics | None = None,
        fetcher: ModelFetcher | None = None,
    ) -> None:
        self.slots = slots
        self.ram = ram
        self.model = MODEL
        self._held: dict[str, list[dict[str, Any]]] = {}  # node → models it reports
        self._resources: dict[str, dict[str, Any]] = {}
        self._fixers: dict[str, str] = {}  # model name → the node whose proof fixed its facts
        self.app = Controller()
        self.read = FakeReadModel(self.app)
        self.live = InProcessLiveState()
        self.gateway = FakeAgentGateway()
        self.loop = asyncio.get_running_loop()
        self.saved = asyncio.Event()
        self.app.add_save_listener(self._on_save)
        self.scheduler_hook: Callable[[], None] = lambda: None
        scheduler = Scheduler(
            self.read,
            self.live,
            SchedulerConfig(DEFAULT_ALLOWED_PEER_CIDRS),
            catch_up=lambda: self.scheduler_hook(),
        )
        self.jobs = JobManager(
            self.app,
            scheduler,
            self.gateway,
            TokenChunkRecorder(self.app),
            queue=AdmissionQueue(queue_max),
            queue_timeout=queue_timeout,
            metrics=metrics,
            fetcher=fetcher,
        )
        self.app.register_model(MODEL["name"], MODEL["sha256"], MODEL["file_name"], 2048)
        self.node_ids = [self.add_node(f"n{i:02d}") for i in range(nodes)]

    def hold_model(self, node_id: str, model: dict[str, Any]) -> None:
        """The node reports the model's file (100 MiB, 1 KiB of KV cache per token) and proves
        it holds it: the first node to do so fixes the model's facts (see
        application/model_claims.py, which the job manager's tests leave out)."""
        claim = {
            "sha256": model["sha256"],
            "file_name": model["file_name"],
            "size_bytes": 100 << 20,
            "layers": 30,
            "kv_bytes_per_token": 1024,
            "context_length": 8192,
        }
        self._held[node_id].append(claim)
        self.app.report_resources(node_id, self._resources[node_id], list(self._held[node_id]))
        fixer = self._fixers.get(model["name"])
        if fixer is None:
            sample = Samples(b"n", (ByteRange(0, 1),), (b"\0" * 32,))
            self.app.prove_first(node_id, model["name"], model["sha256"], claim, sample)
            self._fixers[model["name"]] = node_id
        else:
            self.app.model_proven(node_id, model["sha256"], fixer, facts_of(claim))

    def prove_against_store(self) -> None:
        """Every node that holds a model proves it again against the controller's store copy
        (MODEL_STORED replaced the facts its first proof was checked against), as the
        model-claims sweep would have it do."""
        for node_id, held in self._held.items():
            for claim in held:
                self.app.model_proven(node_id, claim["sha256"], STORE, facts_of(claim))

    def _on_save(self, _position: int) -> None:
        self.loop.call_soon_threadsafe(self.saved.set)

    def add_node(self, name: str, *, holds_model: bool = True, ram: int | None = None) -> str:
        ram = self.ram if ram is None else ram
        node_id = ready_node(self.app, name, ram=ram, slots=self.slots)
        self._held[node_id] = []
        self._resources[node_id] = {"ram_total_bytes": ram, "ram_free_bytes": ram, "gpus": []}
        if holds_model:
            self.hold_model(node_id, MODEL)
        else:
            self.app.report_resources(node_id, self._resources[node_id], [])
        self.live.mark_connected(node_id, True, 0.0)
        self.live.record_heartbeat(node_id, {}, 0.0)
        return node_id

    def _events(self, aggregate_id: str) -> list[Any]:
        return list(self.app.events.get(UUID(aggregate_id)))

    def job_codes(self, job_id: str) -> list[str]:
        return [code_of(e) for e in self._events(job_id)]

    def all_codes(self) -> list[tuple[str, str]]:
        """(code, aggregate id) of every stored event, in store order."""
        out = []
        for notification in self.app.recorder.select_notifications(1, 100_000):
            event = self.app.mapper.to_domain_event(notification)
            out.append((code_of(event), str(event.originator_id)))
        return out

    async def until(self, condition: Callable[[], bool]) -> None:
        """Waits for the store to satisfy ``condition`` (checked after every save)."""

        async def wait() -> None:
            while not condition():
                self.saved.clear()
                if condition():
                    return
                await self.saved.wait()

        await asyncio.wait_for(wait(), GUARD)

    async def primary_assigned(self, count: int) -> list[tuple[str, str]]:
        """Waits until ``count`` primaries were assigned; returns (node, job) of each."""

        async def wait() -> None:
            while len(self.gateway.primaries) < count:
                self.gateway.assigned.clear()
                await self.gateway.assigned.wait()

        await asyncio.wait_for(wait(), GUARD)
        return [(node, a.job_id) for node, a in self.gateway.primaries[:count]]

    async def running_job(self) -> tuple[str, str, JobRun]:
        """One job started, assigned and validated: its node, its id and its run."""
        task = asyncio.create_task(self.jobs.start(submission(), self.model))
        [(node, job)] = await self.primary_assigned(1)
        await self.validate(node, job)
        run = await asyncio.wait_for(task, GUARD)
        return node, job, run

    async def validate(self, node_id: str, job_id: str) -> None:
        await self.jobs.handle(node_id, SetupReported(job_id, SetupOutcome(ok=True)))

    async def finish(self, node_id: str, job_id: str) -> None:
        result = AgentJobResult(ok=True, finish_reason="stop", completion_tokens=1)
        await self.jobs.handle(node_id, JobFinished(job_id, result))
        await self.jobs.settle()


def count(cluster: Cluster, code: str) -> int:
    return sum(1 for c, _ in cluster.all_codes() if c == code)


def queued_count_is(cluster: Cluster, expected: int) -> bool:
    return count(cluster, "JOB_QUEUED") == expected
