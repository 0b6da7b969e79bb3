"""Node diagnosis: what the product document says to capture, and which check fits a failure.

The seed's troubleshooting table maps four symptoms to a check; its last paragraph asks, for a
node, for the agent version, controller version, node state, recent events and whether
failure occurs before or during execution. Everything here is a pure function over plain
dicts (timeline entries from :mod:`application.timeline`, job rows as in the read model), so
the CLI and any other interface only gather inputs and print the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from application.job_manager import CONTROLLER_STOPPING
from application.timeline import short, size_text, source_text, transfer_progress_text
from common.contract import JobErrorCode


@dataclass(frozen=True)
class Hint:
    """One row of the seed's troubleshooting table."""

    key: str
    symptom: str
    likely_cause: str
    check: str


CONTROLLER_UNREACHABLE = Hint(
    "controller_unreachable",
    "gRPC connection refused",
    "Controller is unreachable or the control port is blocked.",
    "Verify controller availability, address, TLS settings and firewall rules.",
)
RPC_WORKER_LOST = Hint(
    "rpc_worker_lost",
    "RPC worker disconnected",
    "The LAN connection dropped or a worker process stopped.",
    "Check the worker address, LAN path and llama.cpp RPC process.",
)
OUT_OF_MEMORY = Hint(
    "out_of_memory",
    "CUDA out of memory",
    "The execution split exceeds available GPU memory.",
    "Use a smaller model or quantization, or revise the execution plan.",
)
PUBLIC_PEER = Hint(
    "public_peer",
    "Public IP security violation",
    "A runtime peer address is outside the permitted private network range.",
    "Keep compute-plane traffic on an approved private LAN.",
)
AGENT_PROTOCOL = Hint(
    "agent_protocol",
    "Agent message rejected",
    "The agent sent a message the controller cannot take: the two versions disagree, or the "
    "agent has a bug.",
    "Compare the agent's and the controller's versions and upgrade the older one; read the "
    "agent's log around the rejected message.",
)
MODEL_TRANSFER = Hint(
    "model_transfer",
    "Model transfer failed",
    "No source could send the model file: the source node's transfer port was unreachable or "
    "refused the ticket, the URL failed, the file did not match its sha256, or the disk is full.",
    "Read the transfer's error; check that this node reaches its sources (the source node's "
    "dacp.transfer_port, its certificate; the URL) and has free disk space, then pull again "
    "(dacp models pull).",
)
MODEL_CLAIM = Hint(
    "model_claim",
    "Model claim refused",
    "The node reports a model's file with another size or shape than the model's registered "
    "facts, or could not prove it holds the file (a wrong, late or missing answer to the "
    "byte-range challenge): it is not planned as that model's primary until it can.",
    "Compare the node's file with the registered model (dacp models list; sha256sum of the "
    "file in the node's --models-dir); a damaged or different file: remove it and let the node "
    "fetch the model again (dacp models pull).",
)
NODE_LOST = Hint(
    "node_lost",
    "Node lost during execution",
    "The node's agent or machine went away while the job ran on it alone (a crash, a kill, "
    "a power or network loss): no RPC worker was involved.",
    "Read the node's agent log (or its service's journal) around the time; restart the agent. "
    "Stop agents with one SIGINT/SIGTERM: they drain their jobs first.",
)
AGENT_STOPPED = Hint(
    "agent_stopped",
    "Agent stopped with jobs running",
    "The node's agent was stopped on purpose, but its jobs did not finish first: its drain "
    "timed out (--drain-timeout), or a second signal stopped it at once.",
    "Give the agent a longer --drain-timeout (DACP_DRAIN_TIMEOUT; and the service manager a "
    "longer stop timeout), or drain the node first (dacp nodes drain) and stop it once idle.",
)
CONTROLLER_STOPPED = Hint(
    "controller_stopped",
    "Controller stopped with jobs running",
    "The controller was stopped (SIGTERM/SIGINT) while the job ran, and the job did not end "
    "within its SHUTDOWN_TIMEOUT.",
    "Give the controller a longer SHUTDOWN_TIMEOUT (and its service manager a longer stop "
    "timeout), or stop it when no job runs.",
)
#: The product document's troubleshooting table (AGENT_PROTOCOL and the rest are ours).
TROUBLESHOOTING: tuple[Hint, ...] = (
    CONTROLLER_UNREACHABLE,
    RPC_WORKER_LOST,
    OUT_OF_MEMORY,
    PUBLIC_PEER,
)

#: Said when no row of the table matches.
NO_HINT_CHECK = "No troubleshooting entry matches; read the recent events and the agent's log."

_OOM = (
    JobErrorCode.OUT_OF_MEMORY,
    "out of memory",
    "out-of-memory",
    "oom",
    "cudamalloc",
    "failed to allocate",
    "insufficient memory",
    "not enough memory",
    "memory exhausted",
)
_SECURITY = (
    "security",
    "public ip",
    "public address",
    "not private",
    "not a private",
    "outside the permitted",
    "outside the allowed",
    "not in allowed",
    "allowed_peer_cidrs",
)
_RPC_WORKER = (
    "rpc worker",
    "rpc-server",
    "rpc server",
    "ggml-rpc",
    "rpc peer",
    "worker disconnected",
)
_LOST = ("node_lost", "lost", "disconnected", "connection reset", "broken pipe", "stream closed")
_CONTROLLER = (
    "connection refused",
    "unavailable",
    "control stream",
    "heartbeat",
    "grpc",
    "not connected",
    "unreachable",
    "tls",
    "handshake",
    "disconnected",
    "node_lost",
)
#: Node events that mean the node left service (a job failing after one is explained by it).
_LOSS_CODES = frozenset({"HEARTBEAT_TIMEOUT", "NODE_OFFLINE", "NODE_ERROR"})
#: The agent stopped on purpose (a finding only when it lost jobs: a clean stop is routine).
_STOP_CODES = frozenset({"NODE_STOPPED"})
#: Node events that are troubles without losing the node.
_TROUBLE_CODES = frozenset(
    {
        "SECURITY_VIOLATION",
        "RPC_WORKER_STOPPED",
        "NODE_MESSAGE_REJECTED",
        "MODEL_TRANSFER_FAILED",
        "MODEL_CLAIM_REFUSED",
    }
)
#: How many of a node's model transfers the report lists (newest first).
TRANSFERS_SHOWN = 10


def _has(text: str, needles: Sequence[str]) -> bool:
    return any(n in text for n in needles)


def classify_text(text: str) -> Hint | None:
    """The troubleshooting row a free-text error or reason points to, if any.

    Memory and peer-address problems are named outright; an RPC worker is named outright;
    then anything about the control channel (refused, closed, heartbeats) is the controller.
    """
    low = text.lower()
    if _has(low, _OOM):
        return OUT_OF_MEMORY
    if _has(low, _SECURITY):
        return PUBLIC_PEER
    if _has(low, _RPC_WORKER):
        return RPC_WORKER_LOST
    if _has(low, _CONTROLLER):
        return CONTROLLER_UNREACHABLE
    return None


def phase_label(phase: str | None) -> str:
    """``before execution (setup)`` or ``during execution`` (the seed's question)."""
    if phase == "setup":
        return "before execution (setup)"
    if phase == "execution":
        return "during execution"
    return "unknown phase"


def _lost_while(
    node_events: Sequence[Mapping[str, Any]], start: str | None, end: str | None
) -> bool:
    """Whether the node left service between ``start`` and ``end`` (UTC ISO times compare
    as text; a missing bound is open)."""
    for e in node_events:
        if e.get("code") not in _LOSS_CODES:
            continue
        moment = str(e.get("time", ""))
        if (start is None or moment >= start) and (end is None or moment <= end):
            return True
    return False


def had_rpc_workers(job: Mapping[str, Any]) -> bool:
    """Whether the job really ran with RPC workers: more nodes than its primary (its
    ``nodes``), or workers in its plan."""
    plan = job.get("plan")
    workers = plan.get("workers") if isinstance(plan, Mapping) else None
    return len(job.get("nodes") or []) > 1 or bool(workers)


def _stopped_with(node_events: Sequence[Mapping[str, Any]], job_id: Any) -> bool:
    """Whether the node's agent stopped on purpose while the job ran (it lists it lost)."""
    return any(
        e.get("code") in _STOP_CODES and job_id in ((e.get("payload") or {}).get("lost_jobs") or [])
        for e in node_events
    )


def classify_job_failure(
    job: Mapping[str, Any], node_events: Sequence[Mapping[str, Any]] = ()
) -> Hint | None:
    """The troubleshooting row for a failed job (a read-model ``jobs`` row).

    A job lost because its node's agent was stopped (NODE_STOPPED lists it) is that stop.
    Losing a node *during execution* is a broken runtime peer (the RPC row) when the job had
    RPC workers, else the node itself; losing it *before* execution is the control channel
    (the controller row) unless the reason names a worker, memory or a peer address.
    ``node_events`` (timeline entries of the node that ran it) explain failures whose reason
    names nothing of the kind.
    """
    reason = str(job.get("failure_reason") or "")
    code = str(job.get("error_code") or "")
    phase = job.get("failure_phase")
    text = f"{reason} {code}".lower()
    if _has(text, _OOM):
        return OUT_OF_MEMORY
    if _has(text, _SECURITY):
        return PUBLIC_PEER
    if code == CONTROLLER_STOPPING:
        return CONTROLLER_STOPPED
    if _stopped_with(node_events, job.get("job_id")):
        return AGENT_STOPPED
    if _has(text, _RPC_WORKER):
        return RPC_WORKER_LOST
    lost_node = _lost_while(node_events, job.get("submitted_at"), job.get("ended_at"))
    if phase == "execution" and (_has(text, _LOST) or lost_node):
        return RPC_WORKER_LOST if had_rpc_workers(job) else NODE_LOST
    if _has(text, _CONTROLLER):
        return CONTROLLER_UNREACHABLE
    if lost_node:
        if phase == "setup":
            return CONTROLLER_UNREACHABLE
        return RPC_WORKER_LOST if had_rpc_workers(job) else NODE_LOST
    return None


def classify_node_event(entry: Mapping[str, Any]) -> Hint | None:
    """The troubleshooting row a node timeline entry calls for (``None``: routine event)."""
    code = entry.get("code")
    payload: Mapping[str, Any] = entry.get("payload") or {}
    if code == "SECURITY_VIOLATION":
        return PUBLIC_PEER
    if code == "NODE_MESSAGE_REJECTED":
        return AGENT_PROTOCOL
    if code == "MODEL_TRANSFER_FAILED":
        return MODEL_TRANSFER
    if code == "MODEL_CLAIM_REFUSED":
        return MODEL_CLAIM
    if code == "HEARTBEAT_TIMEOUT":
        return CONTROLLER_UNREACHABLE
    if code == "NODE_OFFLINE":
        # OFFLINE means no controller connection or heartbeat, whatever the wording.
        return classify_text(str(payload.get("reason", ""))) or CONTROLLER_UNREACHABLE
    if code == "NODE_STOPPED":
        # Stopped on purpose: nothing to check about the network, unless jobs were lost.
        return AGENT_STOPPED if payload.get("lost_jobs") else None
    if code == "NODE_ERROR":
        return classify_text(str(payload.get("message", "")))
    if code == "RPC_WORKER_STOPPED":
        return classify_text(str(payload.get("reason", "")))
    return None


#: How a node last left service, by the event that says so.
_EXITS = {
    "NODE_STOPPED": "stopped",
    "NODE_OFFLINE": "lost",
    "NODE_ERROR": "failed",
    "NODE_REVOKED": "revoked",
}


def last_exit(events: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How the node last left service (None: it never did): ``stopped cleanly`` (its agent
    drained and said goodbye), ``stopped, N job(s) lost`` (its drain timed out, or a second
    signal), ``lost`` (a crash, a kill, the network: no goodbye), ``failed`` or ``revoked``."""
    for entry in reversed(events):
        code = str(entry.get("code"))
        how = _EXITS.get(code)
        if how is None:
            continue
        payload: Mapping[str, Any] = entry.get("payload") or {}
        lost = list(payload.get("lost_jobs") or [])
        if code == "NODE_STOPPED":
            how = f"stopped, {len(lost)} job(s) lost" if lost else "stopped cleanly"
        return {
            "code": code,
            "how": how,
            "time": entry.get("time"),
            "reason": str(payload.get("reason") or payload.get("message") or ""),
            "lost_jobs": lost,
            "summary": entry.get("summary", ""),
        }
    return None


def transfer_history(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The node's model transfers, told by its ``MODEL_TRANSFER_*`` timeline entries, newest
    first: file, size, bytes fetched, sources, and how it ended (``under way`` while no
    ``_COMPLETED`` or ``_FAILED`` came)."""
    transfers: dict[str, dict[str, Any]] = {}
    for entry in events:
        code = str(entry.get("code"))
        if not code.startswith("MODEL_TRANSFER_"):
            continue
        p: Mapping[str, Any] = entry.get("payload") or {}
        transfer_id = str(p.get("transfer_id") or "")
        t = transfers.get(transfer_id)
        if code == "MODEL_TRANSFER_STARTED":
            transfers[transfer_id] = {
                "transfer_id": transfer_id,
                "sha256": p.get("sha256"),
                "file_name": p.get("file_name"),
                "size_bytes": int(p.get("size_bytes") or 0),
                "bytes_done": 0,
                "sources": list(p.get("sources") or []),
                "outcome": "under way",
                "source": None,
                "error": None,
                "started_at": entry.get("time"),
                "ended_at": None,
            }
        elif t is None:
            continue  # its start lies outside the events given
        elif code == "MODEL_TRANSFER_PROGRESS":
            t["bytes_done"] = int(p.get("bytes_done") or 0)
            t["size_bytes"] = int(p.get("size_bytes") or 0) or t["size_bytes"]
        elif code in ("MODEL_TRANSFER_COMPLETED", "MODEL_TRANSFER_FAILED"):
            t["ended_at"] = entry.get("time")
            if code == "MODEL_TRANSFER_COMPLETED":
                t["outcome"], t["source"] = "completed", p.get("source_node_id") or None
                t["bytes_done"] = t["size_bytes"] or t["bytes_done"]
            else:
                t["outcome"], t["error"] = "failed", p.get("error")
    return sorted(transfers.values(), key=lambda t: str(t["started_at"]), reverse=True)


def transfer_line(transfer: Mapping[str, Any]) -> str:
    """One transfer for people: what, how far, from where, how it ended."""
    name = transfer.get("file_name") or str(transfer.get("sha256"))[:12]
    outcome = transfer.get("outcome")
    if outcome == "completed":
        size = int(transfer.get("size_bytes") or 0)
        text = f"{name}: completed" + (f", {size_text(size)}" if size else "")
        if transfer.get("source"):
            text += f" from {source_text(transfer['source'])}"
    else:
        progress = transfer_progress_text(transfer.get("bytes_done"), transfer.get("size_bytes"))
        sources = ", then ".join(source_text(s) for s in transfer.get("sources") or [])
        if outcome == "failed":
            text = f"{name}: failed at {progress} from {sources or 'nowhere'}: "
            text += str(transfer.get("error"))
        else:
            text = f"{name}: {outcome}, {progress} from {sources or 'nowhere'}"
    return f"{text} [transfer {short(transfer.get('transfer_id'))}]"


def _hint_fields(hint: Hint | None) -> dict[str, Any]:
    if hint is None:
        return {"hint": None, "symptom": None, "check": NO_HINT_CHECK}
    return {"hint": hint.key, "symptom": hint.symptom, "check": hint.check}


def node_findings(events: Sequence[Mapping[str, Any]], *, window: int = 50) -> list[dict[str, Any]]:
    """Troubles among the last ``window`` node events, one per (code, hint), newest first."""
    found: dict[tuple[str, str | None], dict[str, Any]] = {}
    for entry in events[-window:] if window > 0 else events:
        code = str(entry.get("code"))
        if code not in _LOSS_CODES | _TROUBLE_CODES | _STOP_CODES:
            continue
        hint = classify_node_event(entry)
        if hint is None and code in ("RPC_WORKER_STOPPED", *_STOP_CODES):
            continue  # an orderly stop
        key = (code, hint.key if hint else None)
        seen = found.get(key)
        found[key] = {
            "code": code,
            "count": (seen["count"] + 1) if seen else 1,
            "first_time": seen["first_time"] if seen else entry.get("time"),
            "last_time": entry.get("time"),
            "summary": entry.get("summary", ""),
            **_hint_fields(hint),
        }
    return sorted(found.values(), key=lambda f: str(f["last_time"]), reverse=True)


def job_report(
    job: Mapping[str, Any], node_events: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """What to say about one failed job: when in its life it failed, why, and what to check."""
    hint = classify_job_failure(job, node_events)
    return {
        "job_id": job.get("job_id"),
        "model": job.get("model"),
        "state": job.get("state"),
        "phase": job.get("failure_phase"),
        "when": phase_label(job.get("failure_phase")),
        "reason": job.get("failure_reason"),
        "error_code": job.get("error_code"),
        "failed_at": job.get("ended_at"),
        "nodes": list(job.get("nodes") or []),
        **_hint_fields(hint),
    }


def diagnose(
    node: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    jobs: Sequence[Mapping[str, Any]],
    controller_version: str,
    *,
    recent: int = 20,
    skips: Sequence[Mapping[str, Any]] = (),
    refusals: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The diagnosis report of one node.

    ``node``: its current state (aggregate attributes or read-model row); ``events``: its
    whole timeline; ``jobs``: rows of jobs that ran on it (any state; failed ones are
    reported, newest first); ``skips``: events of the node or those jobs that the read
    model skipped (its views of them may be stale).
    """
    failed = [j for j in jobs if j.get("state") == "FAILED"]
    failed.sort(key=lambda j: str(j.get("ended_at") or ""), reverse=True)
    reports = [job_report(j, events) for j in failed]
    phases = {r["phase"] for r in reports}
    return {
        "node_id": node.get("node_id") or node.get("id"),
        "name": node.get("name"),
        "address": node.get("address"),
        "agent_version": node.get("agent_version"),
        "controller_version": controller_version,
        "state": node.get("state"),
        "last_state_change": node.get("last_state_change"),
        "drain_requested": bool(node.get("drain_requested")),
        "error": node.get("error"),
        "current_jobs": list(node.get("jobs") or node.get("current_jobs") or []),
        "jobs_considered": len(jobs),
        "failures_before_execution": sum(1 for r in reports if r["phase"] == "setup"),
        "failures_during_execution": sum(1 for r in reports if r["phase"] == "execution"),
        "failure_pattern": _pattern(phases) if reports else "no failed jobs",
        "last_exit": last_exit(events),
        "findings": node_findings(events),
        "transfers": [
            {**t, "line": transfer_line(t)} for t in transfer_history(events)[:TRANSFERS_SHOWN]
        ],
        "failed_jobs": reports,
        "read_model_skips": [dict(skip) for skip in skips],
        "access_refused": [dict(refusal) for refusal in refusals],
        "recent_events": list(events[-recent:]) if recent > 0 else [],
    }


def _pattern(phases: set[Any]) -> str:
    if phases == {"setup"}:
        return "fails before execution (setup)"
    if phases == {"execution"}:
        return "fails during execution"
    return "fails both before and during execution"
