"""How long one scheduling decision takes with many nodes in the read model.

The rows are projected from real events (enrolment, resources, job assignments on warm
servers), so they are the rows a controller reads. Two situations are timed, each
``--decisions`` times: *warm* (half of the model's 100 warm servers have a free slot: the job
joins one) and *cold* (every warm server is full: the split planner starts a new server on an
idle node). ``Scheduler.place`` is what the job manager calls for each placement.

    python -m bench.scheduler_decisions --nodes 1000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from application.commands import Enrollment
from application.controller import Controller
from application.ports import ReadModel
from application.read_models import project_node
from application.scheduler import Scheduler, SchedulerConfig
from bench import stats
from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.model_claims import STORE, facts_of
from domain.placement import ExecutionPlan, PlanNode
from domain.runtimes import runtime_of
from infrastructure.live_state import InProcessLiveState

SHA = "5e" * 32
LOCAL: dict[str, Any] = {
    "sha256": SHA,
    "file_name": "m.gguf",
    "size_bytes": 100 << 20,
    "layers": 30,
    "kv_bytes_per_token": 1024,
    "context_length": 8192,
}
#: The model as the views hold it: its facts from the controller's store (MODEL_STORED).
MODEL = {
    "name": "m",
    "sha256": SHA,
    "file_name": "m.gguf",
    "context_size": 2048,
    "shape": facts_of(LOCAL),
    "shape_from": STORE,
}
#: Warm servers of the model: 100, or a tenth of the nodes when there are fewer than 1,000.
WARM_SERVERS = 100
GIB = 1 << 30


class StaticRows:
    """The read-model port over fixed node rows and MODEL (``list_nodes`` and ``get_model``
    are used)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def list_nodes(self) -> list[dict[str, Any]]:
        return list(self.rows)

    def get_model(self, name: str) -> dict[str, Any] | None:
        return MODEL if name == MODEL["name"] else None


def _rows(nodes: int, *, full: bool) -> tuple[list[dict[str, Any]], list[str]]:
    warm_servers = max(1, min(WARM_SERVERS, nodes // 10))
    app = Controller()
    local = LOCAL
    resources = {"ram_total_bytes": 16 * GIB, "ram_free_bytes": 12 * GIB, "gpus": []}
    ids = []
    for i in range(nodes):
        result = app.enroll(
            Enrollment(
                name=f"node-{i:04d}",
                inventory=resources,
                agent_version="bench",
                address=f"10.{i // 250}.{i % 250}.1",
                rpc_port=50052,
                labels={},
                credential_sha256="c" * 64,
                token_id="t",
                single_use_token=False,
                slots=4,
            )
        )
        node_id = str(result.aggregate_id)
        ids.append(node_id)
        app.mark_ready(node_id)
        holds = i < warm_servers + max(1, warm_servers // 4)  # idle holders for cold plans
        app.report_resources(node_id, resources, [local] if holds else [])
        if holds:  # and proved it holds the file (MODEL_PROVEN)
            app.model_proven(node_id, SHA, STORE, facts_of(local))
    for i, node_id in enumerate(ids[:warm_servers]):
        node = app.get_node(node_id)
        plan = ExecutionPlan(
            "m", SHA, "m.gguf", 2048, 1, PlanNode(node_id, node.address, 50052, 1), (), (1.0,), 4
        )
        jobs = 4 if full or i % 2 else 2
        for j in range(jobs):
            node.assign_job(f"job-{i}-{j}", "primary", runtime=runtime_of(plan))
        app.save(node)
    rows: dict[str, dict[str, Any]] = {}
    for notification in app.recorder.select_notifications(1, 10_000_000):
        event = app.mapper.to_domain_event(notification)
        row = project_node(rows.get(str(event.originator_id)), event)
        if row is not None:
            rows[str(event.originator_id)] = row
    return list(rows.values()), ids


def _time(scheduler: Scheduler, decisions: int) -> tuple[list[float], bool]:
    times, warm = [], True
    for _ in range(decisions):
        start = time.perf_counter()
        result = scheduler.place(MODEL, connected=lambda _n: True)
        times.append(1000 * (time.perf_counter() - start))
        assert result.plan is not None, result.no_capacity
        warm = warm and result.warm
    return times, warm


def measure(nodes: int = 1000, decisions: int = 300) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes}
    every: list[float] = []
    for case, full in (("warm", False), ("cold", True)):
        rows, ids = _rows(nodes, full=full)
        live = InProcessLiveState()
        for node_id in ids:
            live.record_heartbeat(node_id, {"ram_free_bytes": 12 * GIB}, time.time())
        read_model: ReadModel = StaticRows(rows)  # type: ignore[assignment]
        scheduler = Scheduler(read_model, live, SchedulerConfig(DEFAULT_ALLOWED_PEER_CIDRS))
        times, warm = _time(scheduler, decisions)
        if warm != (case == "warm"):
            raise AssertionError(f"the {case} case placed {'warm' if warm else 'cold'}")
        out[f"{case}_p50_ms"] = stats.percentile(times, 50)
        out[f"{case}_p99_ms"] = stats.percentile(times, 99)
        every += times
    out["p50_ms"] = stats.percentile(every, 50)
    out["p99_ms"] = stats.percentile(every, 99)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scheduler_decisions")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=300)
    args = parser.parse_args(argv)
    result = measure(args.nodes, args.decisions)
    for key, value in result.items():
        print(f"{key:>12}  {value:.3f}" if isinstance(value, float) else f"{key:>12}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
