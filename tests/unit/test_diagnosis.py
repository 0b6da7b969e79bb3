"""Failure → troubleshooting hint, and the one-line event summaries (pure functions)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from enum import StrEnum
from typing import Any
from uuid import UUID

import pytest

from application.diagnosis import (
    AGENT_PROTOCOL,
    AGENT_STOPPED,
    CONTROLLER_STOPPED,
    CONTROLLER_UNREACHABLE,
    MODEL_CLAIM,
    NO_HINT_CHECK,
    NODE_LOST,
    OUT_OF_MEMORY,
    PUBLIC_PEER,
    RPC_WORKER_LOST,
    TROUBLESHOOTING,
    Hint,
    classify_job_failure,
    classify_node_event,
    classify_text,
    diagnose,
    last_exit,
    node_findings,
    phase_label,
)
from application.timeline import json_safe, parse_time, summarize

T0 = "2025-01-01T10:00:00+00:00"
T1 = "2025-01-01T10:00:05+00:00"
T2 = "2025-01-01T10:00:09+00:00"


def job(phase: str, reason: str, code: str = "", **extra: Any) -> dict[str, Any]:
    return {
        "job_id": "j1",
        "model": "m",
        "state": "FAILED",
        "failure_phase": phase,
        "failure_reason": reason,
        "error_code": code,
        "submitted_at": T0,
        "ended_at": T2,
        **extra,
    }


def event(code: str, time: str = T1, **payload: Any) -> dict[str, Any]:
    return {"code": code, "time": time, "summary": summarize(code, payload), "payload": payload}


def test_the_seed_table_is_complete() -> None:
    checks = {h.check for h in TROUBLESHOOTING}
    assert checks == {
        "Verify controller availability, address, TLS settings and firewall rules.",
        "Check the worker address, LAN path and llama.cpp RPC process.",
        "Use a smaller model or quantization, or revise the execution plan.",
        "Keep compute-plane traffic on an approved private LAN.",
    }


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("failed to connect: gRPC connection refused", CONTROLLER_UNREACHABLE),
        ("StatusCode.UNAVAILABLE: failed to connect to all addresses", CONTROLLER_UNREACHABLE),
        ("control stream closed", CONTROLLER_UNREACHABLE),
        ("no heartbeat for 16.0 s", CONTROLLER_UNREACHABLE),
        ("RPC worker disconnected", RPC_WORKER_LOST),
        ("ggml-rpc-server exited with code 1", RPC_WORKER_LOST),
        ("CUDA error: out of memory", OUT_OF_MEMORY),
        ("ggml_backend_cuda_buffer_type_alloc_buffer: cudaMalloc failed", OUT_OF_MEMORY),
        ("peer 8.8.8.8 is a public IP outside the permitted range", PUBLIC_PEER),
        ("model sha256 mismatch", None),
    ],
)
def test_classify_text(text: str, hint: Hint | None) -> None:
    assert classify_text(text) == hint


def test_node_lost_during_execution_is_the_rpc_row_when_the_job_had_rpc_workers() -> None:
    failed = job(
        "execution", "node node-b lost: control stream closed", "node_lost", nodes=["a", "b"]
    )
    assert classify_job_failure(failed) == RPC_WORKER_LOST


def test_a_job_without_rpc_workers_never_gets_the_rpc_row() -> None:
    # One node, lost while the job ran on it: the node's row, not a worker it never had.
    alone = job("execution", "node node-a lost: control stream closed", "node_lost", nodes=["a"])
    assert classify_job_failure(alone) == NODE_LOST
    assert classify_job_failure(job("execution", "node x was lost", "node_lost")) == NODE_LOST
    offline = [event("NODE_OFFLINE", T1, reason="no heartbeat for 16 s", lost_jobs=["j1"])]
    assert classify_job_failure(job("execution", "generation failed"), offline) == NODE_LOST
    planned = {"primary": {"node_id": "a"}, "workers": [{"node_id": "b"}]}
    with_plan = job("execution", "generation failed", plan=planned, nodes=["a"])
    assert classify_job_failure(with_plan, offline) == RPC_WORKER_LOST
    assert "RPC" not in NODE_LOST.check and "firewall" not in NODE_LOST.check


def test_a_job_lost_to_a_stopped_agent_is_that_stop() -> None:
    stopped = [
        event("NODE_STOPPING", T0, drain_timeout_seconds=60.0, running_jobs=["j1"]),
        event(
            "NODE_STOPPED",
            T1,
            reason="its drain timed out after 60 s with 1 job(s) running",
            lost_jobs=["j1"],
        ),
    ]
    failed = job(
        "execution",
        "node a stopped (its drain timed out after 60 s with 1 job(s) running) during execution",
        "node_lost",
        nodes=["a", "b"],
    )
    assert classify_job_failure(failed, stopped) == AGENT_STOPPED
    assert "--drain-timeout" in AGENT_STOPPED.check
    # Another job, not among the stop's lost jobs, is judged as before.
    other = {**failed, "job_id": "j9", "failure_reason": "RPC worker disconnected"}
    assert classify_job_failure(other, stopped) == RPC_WORKER_LOST


def test_a_job_the_controller_ended_as_it_stopped_names_shutdown_timeout() -> None:
    ended = job(
        "execution",
        "the controller stopped: the job did not end within SHUTDOWN_TIMEOUT (30 s)",
        "controller_stopping",
        nodes=["a"],
    )
    assert classify_job_failure(ended) == CONTROLLER_STOPPED
    assert "SHUTDOWN_TIMEOUT" in CONTROLLER_STOPPED.check


def test_a_device_out_of_memory_by_its_code_alone_is_the_seeds_memory_row() -> None:
    # The agent's code (common.contract.OUT_OF_MEMORY), whatever the reason's words.
    failed = job("execution", "device CUDA1 of node gpu-2: cudaMalloc failed", "out_of_memory")
    hint = classify_job_failure(failed)
    assert hint == OUT_OF_MEMORY
    assert (
        hint is not None
        and hint.check == "Use a smaller model or quantization, or revise the execution plan."
    )


def test_node_lost_before_execution_is_the_controller_row() -> None:
    failed = job("setup", "setup failed after 4 plans: NODE_LOST: node x disconnected")
    assert classify_job_failure(failed) == CONTROLLER_UNREACHABLE


def test_a_named_worker_or_memory_wins_over_the_phase() -> None:
    assert classify_job_failure(job("setup", "RPC worker on node x failed: bind")) == (
        RPC_WORKER_LOST
    )
    assert classify_job_failure(job("execution", "llama-server: out of memory")) == OUT_OF_MEMORY
    assert classify_job_failure(job("setup", "", "security_violation")) == PUBLIC_PEER


def test_node_events_explain_a_vague_reason() -> None:
    vague = job("setup", "primary node x did not validate setup in time")
    assert classify_job_failure(vague) is None
    offline = [event("NODE_OFFLINE", T1, reason="no heartbeat for 16 s", lost_jobs=[])]
    assert classify_job_failure(vague, offline) == CONTROLLER_UNREACHABLE
    running = job("execution", "generation failed", nodes=["x", "w"])
    assert classify_job_failure(running, offline) == RPC_WORKER_LOST
    # A loss long before the job was submitted explains nothing.
    old = [event("NODE_OFFLINE", "2024-01-01T00:00:00+00:00", reason="x", lost_jobs=[])]
    assert classify_job_failure(vague, old) is None


def test_node_events() -> None:
    assert classify_node_event(event("SECURITY_VIOLATION", address="1.2.3.4")) == PUBLIC_PEER
    assert classify_node_event(event("HEARTBEAT_TIMEOUT", seconds_since_last=7.0)) == (
        CONTROLLER_UNREACHABLE
    )
    assert classify_node_event(event("NODE_OFFLINE", reason="whatever", lost_jobs=[])) == (
        CONTROLLER_UNREACHABLE
    )
    assert classify_node_event(event("NODE_ERROR", message="CUDA out of memory")) == (OUT_OF_MEMORY)
    assert classify_node_event(event("NODE_ERROR", message="disk on fire")) is None
    assert classify_node_event(event("RPC_WORKER_STOPPED", reason="job ended")) is None
    assert classify_node_event(event("NODE_READY")) is None


def test_a_clean_stop_is_no_finding_and_gives_no_network_advice() -> None:
    clean = [
        event("NODE_READY", T0),
        event("NODE_STOPPING", T0, drain_timeout_seconds=60.0, running_jobs=["j1"]),
        event("NODE_STOPPED", T1, reason="drained (1 job(s) finished)", lost_jobs=[]),
    ]
    assert classify_node_event(clean[1]) is None
    assert classify_node_event(clean[2]) is None
    assert node_findings(clean) == []
    node = {"id": "n1", "name": "gpu-1", "state": "OFFLINE", "jobs": []}
    report = diagnose(node, clean, [{"job_id": "j1", "state": "COMPLETED"}], "1")
    assert report["findings"] == [] and report["failed_jobs"] == []
    assert report["last_exit"]["how"] == "stopped cleanly"
    assert report["last_exit"]["summary"] == "stopped cleanly (drained (1 job(s) finished))"
    text = repr(report).lower()
    assert "firewall" not in text and "tls" not in text and "rpc" not in text


def test_a_stop_that_lost_jobs_is_a_finding_and_a_crash_is_lost() -> None:
    lost = event(
        "NODE_STOPPED", T1, reason="stopped at once by a second signal (SIGINT)", lost_jobs=["j1"]
    )
    assert classify_node_event(lost) == AGENT_STOPPED
    [finding] = node_findings([event("NODE_READY", T0), lost])
    assert (finding["code"], finding["hint"]) == ("NODE_STOPPED", "agent_stopped")
    assert last_exit([lost]) == {
        "code": "NODE_STOPPED",
        "how": "stopped, 1 job(s) lost",
        "time": T1,
        "reason": "stopped at once by a second signal (SIGINT)",
        "lost_jobs": ["j1"],
        "summary": lost["summary"],
    }
    crash = event("NODE_OFFLINE", T2, reason="no heartbeat for 16.0 s", lost_jobs=[])
    exit_ = last_exit([event("NODE_STOPPED", T0, reason="drained", lost_jobs=[]), crash])
    assert exit_ is not None and (exit_["code"], exit_["how"]) == ("NODE_OFFLINE", "lost")
    assert last_exit([event("NODE_READY", T0)]) is None


def test_findings_are_grouped_newest_first() -> None:
    events = [
        event("NODE_READY", T0),
        event("HEARTBEAT_TIMEOUT", T0, seconds_since_last=7.0),
        event("SECURITY_VIOLATION", T1, address="8.8.8.8", reason="public", job_id=""),
        event("HEARTBEAT_TIMEOUT", T2, seconds_since_last=8.5),
        event("RPC_WORKER_STOPPED", T2, job_id="j", reason="job ended"),
    ]
    found = node_findings(events)
    assert [(f["code"], f["count"]) for f in found] == [
        ("HEARTBEAT_TIMEOUT", 2),
        ("SECURITY_VIOLATION", 1),
    ]
    assert found[0]["first_time"] == T0 and found[0]["last_time"] == T2
    assert found[0]["summary"] == "no heartbeat for 8.5 s"
    assert found[1]["check"] == PUBLIC_PEER.check


def test_diagnose_report() -> None:
    node = {
        "id": "n1",
        "name": "gpu-1",
        "agent_version": "0.2.0",
        "state": "OFFLINE",
        "last_state_change": T2,
        "jobs": [],
    }
    events = [event("NODE_READY", T0), event("NODE_OFFLINE", T1, reason="x", lost_jobs=["j1"])]
    jobs = [
        job("execution", "node gpu-1 lost: control stream closed", "node_lost", nodes=["n1", "w"]),
        {**job("setup", "mystery"), "job_id": "j0", "ended_at": T1},
        {"job_id": "j2", "state": "COMPLETED"},
    ]
    report = diagnose(node, events, jobs, "9.9.9", recent=1)
    assert report["node_id"] == "n1" and report["controller_version"] == "9.9.9"
    assert report["agent_version"] == "0.2.0" and report["state"] == "OFFLINE"
    assert [j["job_id"] for j in report["failed_jobs"]] == ["j1", "j0"]
    assert report["failed_jobs"][0]["when"] == "during execution"
    assert report["failed_jobs"][0]["check"] == RPC_WORKER_LOST.check
    # j0 failed in setup right when the node went offline: the controller row
    assert report["failed_jobs"][1]["check"] == CONTROLLER_UNREACHABLE.check
    assert report["failure_pattern"] == "fails both before and during execution"
    assert (report["failures_before_execution"], report["failures_during_execution"]) == (1, 1)
    assert report["recent_events"] == events[-1:]
    assert report["jobs_considered"] == 3

    quiet = diagnose(node, [], [{"job_id": "j", "state": "FAILED"}], "1")
    assert quiet["failed_jobs"][0]["check"] == NO_HINT_CHECK
    assert quiet["failed_jobs"][0]["when"] == "unknown phase"
    assert diagnose(node, [], [], "1")["failure_pattern"] == "no failed jobs"


def test_phase_label() -> None:
    assert phase_label("setup") == "before execution (setup)"
    assert phase_label("execution") == "during execution"


@pytest.mark.parametrize(
    ("code", "payload", "line"),
    [
        ("HEARTBEAT_TIMEOUT", {"seconds_since_last": 7}, "no heartbeat for 7.0 s"),
        (
            "JOB_FAILED",
            {"phase": "execution", "reason": "boom", "error_code": ""},
            "phase=execution reason=boom",
        ),
        (
            "TOKEN_STREAM_CHUNK",
            {"deltas": [{"seq": 10}, {"seq": 11}, {"seq": 12}], "token_count": 4},
            "3 deltas, 4 tokens, seq 10-12",
        ),
        (
            "TOKEN_STREAM_CHUNK",
            {"deltas": [{"seq": 0}], "token_count": 1},
            "1 delta, 1 token, seq 0",
        ),
        (
            "NODE_OFFLINE",
            {"reason": "control stream closed", "lost_jobs": ["0123456789ab"]},
            "control stream closed; lost jobs 01234567",
        ),
        (
            "NODE_STOPPING",
            {"drain_timeout_seconds": 60.0, "running_jobs": ["a", "b"]},
            "stopping (drain): 2 job(s) running, at most 60 s",
        ),
        ("NODE_STOPPED", {"reason": "drained", "lost_jobs": []}, "stopped cleanly (drained)"),
        (
            "NODE_STOPPED",
            {"reason": "its drain timed out after 5 s", "lost_jobs": ["0123456789ab"]},
            "stopped with jobs running: its drain timed out after 5 s; lost jobs 01234567",
        ),
        (
            "NODE_MESSAGE_REJECTED",
            {"kind": "token_chunk", "job_id": "0123456789ab", "reason": "r", "suppressed": 4},
            "token_chunk rejected (job 01234567): r; 4 more not recorded",
        ),
        (
            "NODE_MESSAGE_REJECTED",
            {"kind": "hello", "job_id": "", "reason": "a second Hello", "suppressed": 0},
            "hello rejected: a second Hello",
        ),
        (
            "JOB_PLANNED",
            {
                "plan": {
                    "primary": {"node_id": "aaaaaaaa-1"},
                    "workers": [{"node_id": "bbbbbbbb-2"}],
                    "tensor_split": [0.75, 0.25],
                    "context_size": 2048,
                }
            },
            "primary=aaaaaaaa workers=1 [bbbbbbbb] split=0.75/0.25 ctx=2048/slot",
        ),
        (
            "JOB_PLANNED",
            {"plan": {"primary": {"node_id": "aaaaaaaa-1"}, "context_size": 2048, "parallel": 4}},
            "primary=aaaaaaaa workers=0 ctx=2048/slot x4 slots",
        ),
        ("SOMETHING_NEW", {"a": 1, "b": "x", "c": [1]}, "a=1 b=x"),
        ("HEARTBEAT_TIMEOUT", {"seconds_since_last": "n/a"}, "seconds_since_last=n/a"),
    ],
)
def test_summaries(code: str, payload: dict[str, Any], line: str) -> None:
    assert summarize(code, payload) == line


class Colour(StrEnum):
    RED = "RED"


def test_json_safe_and_times() -> None:
    moment = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    value = {"u": UUID(int=1), "t": moment, "e": Colour.RED, "s": {2, 1}, "b": b"\x01", "x": (1,)}
    assert json_safe(value) == {
        "u": "00000000-0000-0000-0000-000000000001",
        "t": "2025-01-02T01:04:05+00:00",
        "e": "RED",
        "s": [1, 2],
        "b": "01",
        "x": [1],
    }
    assert parse_time("2025-01-02T01:04:05Z") == datetime(2025, 1, 2, 1, 4, 5, tzinfo=UTC)
    assert parse_time("2025-01-02T01:04:05") == datetime(2025, 1, 2, 1, 4, 5, tzinfo=UTC)
    with pytest.raises(ValueError):
        parse_time("yesterday")


def test_a_rejected_agent_message_is_a_finding_with_the_protocol_hint() -> None:
    rejected = event("NODE_MESSAGE_REJECTED", kind="hello", job_id="", reason="x", suppressed=0)
    assert classify_node_event(rejected) == AGENT_PROTOCOL
    [finding] = node_findings([event("NODE_READY", T0), rejected])
    assert (finding["code"], finding["hint"]) == ("NODE_MESSAGE_REJECTED", "agent_protocol")


def test_a_refused_model_claim_is_a_finding_with_its_own_hint() -> None:
    refused = event(
        "MODEL_CLAIM_REFUSED",
        sha256="ab" * 32,
        file_name="m.gguf",
        reason="it claims size_bytes 1, not 2 (the model's registered facts)",
        claim={},
        basis="store",
    )
    assert classify_node_event(refused) == MODEL_CLAIM
    [finding] = node_findings([event("NODE_READY", T0), refused])
    assert (finding["code"], finding["hint"]) == ("MODEL_CLAIM_REFUSED", "model_claim")
    assert "dacp models pull" in finding["check"]
