"""What one node or one caller may cost the control channel, on fakes: bounded text, the rate
budgets, the gate for unauthenticated streams, a node's bounded outbox, the strings of a
node's message cut before anything keeps them, and node credentials checked from memory."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from application.agent_messages import Rejection
from application.enrollment import (
    STORE_READS,
    EnrollmentService,
    Unauthenticated,
    credential_sha256,
)
from application.errors import NotFound
from application.rejections import AUDIT_INTERVAL, PendingGate, RateBudget, RejectionAudit
from domain.bounded_text import ID_MAX, NODE_NAME_MAX, TEXT_MAX, bounded, node_name_problem
from domain.node import Node
from infrastructure.live_state import InProcessLiveState
from interfaces.grpc.grpc_convert import MAX_REPORTED_MODELS, clamp_strings, local_models_to_list
from interfaces.grpc.grpc_server import (
    FAULT_BURST,
    REJECTION_BURST,
    AgentConnections,
    ControlPlaneServicer,
    Outbox,
)
from tests.unit.domain_builders import new_node
from wire import control_pb2 as pb

# ------------------------------------------------------------------ bounded text


def test_bounded_text_is_printable_and_cut_with_what_was_left_out() -> None:
    assert bounded("gpu-box-1", 64) == "gpu-box-1"  # what is fine stays as it is
    cut = bounded("evil\x00" + "n" * 1000, 20)
    assert cut.startswith("evil\\x00nnnnnnnnnnnn") and "\x00" not in cut
    assert cut.endswith("(+988 characters)")
    assert bounded("line one\nline two", 100) == "line one\\nline two"
    assert bounded("line one\nline two", 100, keep_newlines=True) == "line one\nline two"
    assert bounded("\u202eevil", 100) == "\\u202eevil"  # a bidi override is not printable


@pytest.mark.parametrize(
    "name", ["gpu-box-1", "MacBook-Pro.local", "node_7", "node-ü", "x" * NODE_NAME_MAX]
)
def test_node_names_that_are_fine(name: str) -> None:
    assert node_name_problem(name) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "must not be empty"),
        ("x" * (NODE_NAME_MAX + 1), f"{NODE_NAME_MAX + 1} characters long"),
        ("evil\x00", "'\\x00' at position 4"),
        ("-lead", "'-' at position 0"),
        ("two words", "' ' at position 3"),
        ("a/b", "'/' at position 1"),
    ],
)
def test_node_names_that_are_refused_say_why(name: str, why: str) -> None:
    problem = node_name_problem(name)
    assert problem is not None and why in problem
    assert "letters, digits" in problem or not name


# ---------------------------------------------------------------------- budgets


def test_a_rate_budget_allows_a_burst_then_its_rate_and_counts_the_rest() -> None:
    budget = RateBudget(rate=2.0, burst=3)
    assert [budget.take("a", 100.0) for _ in range(4)] == [True, True, True, False]
    assert budget.take("b", 100.0)  # each key has its own
    assert not budget.take("a", 100.2)  # 0.4 of a token
    assert budget.take("a", 100.6)  # 1.2 tokens by now
    assert budget.dropped("a") == 2 and budget.dropped("a") == 0


def test_budgets_and_audits_forget_the_least_recent_keys_beyond_their_bound() -> None:
    budget = RateBudget(rate=1.0, burst=1, max_keys=3)
    audit = RejectionAudit(interval=10.0, max_keys=3)
    for i in range(10):
        budget.take(f"k{i}", 0.0)
        audit.note(f"k{i}", 0.0)
    assert len(budget._buckets) == 3 and len(audit._last) == 3
    assert budget.take("k0", 0.0)  # forgotten: a fresh bucket


async def test_the_gate_holds_places_per_key_and_in_all_and_lets_waiters_in_turn() -> None:
    gate = PendingGate(2, 3, waiting_per_key=1, waiting_total=2)
    assert await gate.enter("a", 0.01) and await gate.enter("a", 0.01)
    assert await gate.enter("b", 0.01)  # 3 in all now
    assert not await gate.enter("c", 0.01)  # waited its turn in vain
    waiting = asyncio.create_task(gate.enter("a", 5.0))
    await asyncio.sleep(0)
    assert gate.waiting == 1
    assert not await gate.enter("a", 5.0)  # one of "a" waits already: no more
    gate.leave("b")  # a place in all, and "a" has none of its own free yet
    await asyncio.sleep(0)
    assert not waiting.done()
    gate.leave("a")
    assert await waiting
    assert gate.pending == 2 and gate.waiting == 0


async def test_a_waiter_given_a_place_as_it_is_cancelled_hands_it_on() -> None:
    gate = PendingGate(1, 1, waiting_per_key=5, waiting_total=5)
    assert await gate.enter("a", 1.0)
    first = asyncio.create_task(gate.enter("a", 5.0))
    second = asyncio.create_task(gate.enter("a", 5.0))
    await asyncio.sleep(0)
    gate.leave("a")  # the place goes to the first waiter...
    first.cancel()  # ...which is cancelled before it runs
    try:
        held = await first  # (Python 3.11's wait_for may still return the place)
    except asyncio.CancelledError:
        held = False  # handed on
    if held:
        gate.leave("a")
    assert await second  # either way the second gets it, and no place is lost
    assert gate.pending == 1


# ----------------------------------------------------------------------- outbox


async def test_a_node_that_does_not_read_is_disconnected_not_buffered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    connections = AgentConnections(max_messages=3, max_bytes=1 << 20)
    connections.bind(asyncio.get_running_loop())
    outbox = connections.open("n1")
    message = pb.ControllerMessage(cancel_job=pb.CancelJob(job_id="j"))
    assert all(connections.send("n1", message) for _ in range(3))
    assert not connections.send("n1", message)  # the fourth: over the bound
    assert connections.overflows == 1 and "does not read its control stream" in caplog.text
    assert outbox.closed and outbox.bytes == 0
    assert await outbox.get() is not message  # what waited is dropped: the stream ends
    assert not connections.send("n1", message)  # and takes nothing more
    assert connections.overflows == 1


async def test_the_outbox_bounds_bytes_too_and_a_healthy_stream_gets_everything() -> None:
    connections = AgentConnections(max_messages=100, max_bytes=10_000)
    connections.bind(asyncio.get_running_loop())
    outbox = connections.open("n1")
    plan = pb.ControllerMessage(execution_plan=pb.ExecutionPlan(job_id="j", model_name="x" * 4000))
    assert connections.send("n1", plan) and connections.send("n1", plan)
    assert outbox.bytes == 2 * plan.ByteSize()
    assert await outbox.get() is plan  # read: room again
    assert connections.send("n1", plan)
    assert not connections.send("n1", plan)  # 3 x 4 kB waiting: over 10 kB
    assert connections.overflows == 1


# ------------------------------------------------------------- a node's strings


def test_a_nodes_strings_are_cut_before_anything_keeps_them() -> None:
    inv = pb.Inventory(hostname="h" * 10_000, cpu_model="ok")
    inv.labels["k" * 500] = "v\x00" * 500
    inv.gpus.add(name="g" * 1000)
    report = pb.AgentMessage(
        resource_report=pb.ResourceReport(
            inventory=inv, models=[pb.LocalModel(file_name="f" * 1000, error="e" * 10_000)]
        )
    )
    clamp_strings(report)
    kept = report.resource_report
    assert len(kept.inventory.hostname) < ID_MAX + 30 and kept.inventory.cpu_model == "ok"
    [(key, value)] = kept.inventory.labels.items()
    assert len(key) < ID_MAX + 30 and "\x00" not in value
    assert len(kept.inventory.gpus[0].name) < ID_MAX + 30
    assert len(kept.models[0].file_name) < ID_MAX + 30
    assert len(kept.models[0].error) < TEXT_MAX + 30
    fault = pb.AgentMessage(runtime_fault=pb.RuntimeFault(message="one\ntwo" + "x" * 10_000))
    clamp_strings(fault)
    assert fault.runtime_fault.message.startswith("one\ntwo")
    assert len(fault.runtime_fault.message) < TEXT_MAX + 30
    # What is relayed to a client is the message size limit's business, not this.
    tokens = pb.AgentMessage(
        job_result=pb.JobResult(job_id="j", output_json="[" + "1," * 10_000 + "1]")
    )
    clamp_strings(tokens)
    assert len(tokens.job_result.output_json) > 20_000


def test_a_report_listing_too_many_models_is_refused() -> None:
    models = [pb.LocalModel(file_name=f"m{i}.gguf") for i in range(MAX_REPORTED_MODELS + 1)]
    with pytest.raises(ValueError, match="more than the"):
        local_models_to_list(models)


# ---------------------------------------------------------------- credentials


class _Store:
    """The part of the Controller that credential checks read: nodes by id."""

    def __init__(self) -> None:
        self.nodes: dict[str, Any] = {}
        self.reads = 0

    def get_node(self, node_id: str) -> Any:
        self.reads += 1
        if node_id not in self.nodes:
            raise NotFound("node", node_id)
        return self.nodes[node_id]


def _service(store: _Store) -> EnrollmentService:
    return EnrollmentService(store, "secret")  # type: ignore[arg-type]


def _node(credential: str) -> Node:
    return new_node(credential_sha256=credential_sha256(credential))


async def test_credentials_are_checked_from_memory_once_known() -> None:
    store = _Store()
    service = _service(store)
    node = _node("right")
    node_id = str(node.id)
    [enrolled] = node.collect_events()
    service.on_event(1, enrolled)  # as the projection follower applies it
    assert await service.authenticate(node_id, "right", 0.0) == node_id
    with pytest.raises(Unauthenticated, match="wrong credential"):
        await service.authenticate(node_id, "wrong", 0.0)
    with pytest.raises(Unauthenticated, match="not a node id"):
        await service.authenticate("x" * 10_000, "right", 0.0)
    with pytest.raises(Unauthenticated, match="missing"):
        await service.authenticate(node_id, "", 0.0)
    assert store.reads == 0
    node.revoke("stolen", "admin")
    [revoked] = node.collect_events()
    service.on_event(2, revoked)
    assert service.is_revoked(node_id)
    with pytest.raises(Unauthenticated, match="was revoked"):
        await service.authenticate(node_id, "right", 0.0)
    assert store.reads == 0


async def test_a_node_the_cache_lacks_is_read_once_and_unknown_ids_are_remembered() -> None:
    store = _Store()
    service = _service(store)
    known = str(uuid.uuid4())
    store.nodes[known] = SimpleNamespace(revoked=False, credential_sha256=credential_sha256("c"))
    assert await service.authenticate(known, "c", 0.0) == known
    assert await service.authenticate(known, "c", 0.0) == known
    assert store.reads == 1  # then from memory
    stranger = str(uuid.uuid4())
    for _ in range(5):
        with pytest.raises(Unauthenticated, match="unknown node"):
            await service.authenticate(stranger, "c", 1.0)
    assert store.reads == 2  # unknown: remembered for a while
    with pytest.raises(Unauthenticated):
        await service.authenticate(stranger, "c", 1000.0)
    assert store.reads == 3  # and read again later


async def test_store_reads_for_unknown_ids_run_a_few_at_a_time() -> None:
    store = _Store()
    service = _service(store)
    running = 0
    most = 0

    def slow_read(node_id: str) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        time.sleep(0.02)
        running -= 1
        raise NotFound("node", node_id)

    store.get_node = slow_read  # type: ignore[method-assign]
    attempts = [service.authenticate(str(uuid.uuid4()), "c", 0.0) for _ in range(10)]
    results = await asyncio.gather(*attempts, return_exceptions=True)
    assert all(isinstance(r, Unauthenticated) for r in results)
    assert most <= STORE_READS


# ------------------------------------------------------ a node's budgets, in the servicer


class _App:
    """The Controller commands a node's messages lead to, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def report_resources(self, *args: Any) -> int:
        self.calls.append(("report_resources", args))
        return 1

    def report_node_error(self, *args: Any) -> int:
        self.calls.append(("report_node_error", args))
        return 1

    def reject_message(self, *args: Any) -> int:
        self.calls.append(("reject_message", args))
        return 1

    def of(self, name: str) -> list[tuple[Any, ...]]:
        return [args for called, args in self.calls if called == name]


def _servicer(app: _App, clock: list[float]) -> tuple[ControlPlaneServicer, Outbox]:
    connections = AgentConnections()
    connections.bind(asyncio.get_running_loop())
    servicer = ControlPlaneServicer(
        app=app,  # type: ignore[arg-type]
        enrollment=_service(_Store()),
        live=InProcessLiveState(),
        connections=connections,
        heartbeat_interval=1.0,
        clock=lambda: clock[0],
    )
    return servicer, connections.open("n1")


async def _settled(app: _App, name: str, count: int) -> list[tuple[Any, ...]]:
    for _ in range(200):
        if len(app.of(name)) >= count:
            break
        await asyncio.sleep(0.01)
    return app.of(name)


async def test_resource_reports_are_recorded_once_per_interval_the_newest_kept() -> None:
    app = _App()
    servicer, _ = _servicer(app, [0.0])

    def report(host: str) -> pb.AgentMessage:
        inv = pb.Inventory(hostname=host, ram_total_bytes=1 << 30)
        return pb.AgentMessage(resource_report=pb.ResourceReport(inventory=inv))

    for host in ("first", "second", "third", "fourth"):
        assert await servicer._on_message("n1", report(host))
    [first] = await _settled(app, "report_resources", 1)
    assert first[1]["hostname"] == "first"  # at once
    later = await _settled(app, "report_resources", 2)  # after REPORT_INTERVAL
    assert [args[1]["hostname"] for args in later] == ["first", "fourth"]
    assert servicer.over_budget["resource_report"] == 2  # second and third: replaced


async def test_refusals_and_faults_beyond_a_nodes_budget_are_counted_only() -> None:
    app = _App()
    clock = [100.0]
    servicer, outbox = _servicer(app, clock)
    bad = pb.AgentMessage(token_chunk=pb.TokenChunk(job_id="j" * 10_000))  # no deltas
    servicer.uplink = _Uplink()
    for _ in range(REJECTION_BURST + 30):
        await servicer._on_message("n1", bad)
    assert servicer.rejected["token_chunk"] == REJECTION_BURST + 30
    assert outbox.qsize() == REJECTION_BURST  # answered: the burst
    answer = await outbox.get()
    assert len(answer.message_rejected.job_id) < ID_MAX + 30  # echoed cut
    assert servicer.over_budget["message_rejected"] == 30
    [recorded] = await _settled(app, "reject_message", 1)  # one per interval
    assert len(recorded[2]) < ID_MAX + 30
    clock[0] += AUDIT_INTERVAL
    await servicer._on_message("n1", bad)
    later = await _settled(app, "reject_message", 2)
    assert later[1][4] == REJECTION_BURST + 30 - 1  # the suppressed ones, counted
    for _ in range(FAULT_BURST + 5):
        fault = pb.RuntimeFault(message="m" * 10_000, fatal=True)
        await servicer._on_message("n1", pb.AgentMessage(runtime_fault=fault))
    errors = await _settled(app, "report_node_error", FAULT_BURST)
    await asyncio.sleep(0.05)
    assert len(app.of("report_node_error")) == FAULT_BURST
    assert all(len(args[1]) < TEXT_MAX + 30 for args in errors)
    assert servicer.over_budget["runtime_fault"] == 5


class _Uplink:
    """The job manager's answer to a token chunk without deltas (the bridge's)."""

    async def on_agent_message(self, node_id: str, message: pb.AgentMessage) -> Rejection:
        return Rejection("a token chunk without a job id or deltas", message.token_chunk.job_id)

    async def on_node_disconnected(self, node_id: str) -> None:
        return None

    async def on_node_gone(self, node_id: str, reason: str = "") -> None:
        return None

    async def messages_handled(self) -> None:
        return None

    def resumed_jobs(self, node_id: str) -> list[tuple[str, int]]:
        return []
