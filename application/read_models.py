"""The read side (CQRS): pure functions from events to read-model rows (the query port over
them is :class:`application.ports.ReadModel`).

Rows are plain JSON-safe dicts derived from events only (times come from the events, never
from a clock), so rebuilding from position zero yields identical rows.
"""

from __future__ import annotations

from typing import Any

from domain.access_refusal import AccessRefusal
from domain.api_key import CHANGEABLE, ApiKey
from domain.catalog import code_of
from domain.issued_token import IssuedToken
from domain.job import Job
from domain.model import RegisteredModel, shape_of, use_of
from domain.model_claims import STORE, facts_of
from domain.node import Node, still_proven
from domain.runtimes import runtime_capacity, runtime_key
from domain.states import NodeState


def _free_memory_bytes(resources: dict[str, Any]) -> int:
    """Usable host memory of a node: its free RAM when it lists its devices (its GPUs are then
    planned one by one); else, as agents before devices reported it, its GPUs' free memory,
    else its free RAM."""
    gpus = [] if resources.get("devices") else resources.get("gpus") or []
    gpu_free = sum(int(g.get("memory_free_bytes", 0)) for g in gpus if isinstance(g, dict))
    if gpu_free > 0:
        return gpu_free
    return int(resources.get("ram_free_bytes") or resources.get("ram_total_bytes") or 0)


#: How many failed model transfers a node row keeps in ``transfer_failures`` (newest first).
TRANSFER_FAILURES_KEPT = 3


def transfer_failure(
    transfer_id: str, sha256: str, error: str, at: str, started: dict[str, Any]
) -> dict[str, Any]:
    """An entry of a node row's ``transfer_failures``: the failed transfer as its row in
    ``transfers`` last had it (``started``; empty when the row never recorded its start, so
    ``file_name`` and ``started_at`` are None), with its error and when it failed."""
    return {
        "transfer_id": transfer_id,
        "sha256": sha256,
        "file_name": started.get("file_name"),
        "error": error,
        "failed_at": at,
        "started_at": started.get("started_at"),
        "bytes_done": int(started.get("bytes_done") or 0),
        "size_bytes": int(started.get("size_bytes") or 0),
        "sources": list(started.get("sources") or []),
    }


def project_node(row: dict[str, Any] | None, event: object) -> dict[str, Any] | None:
    """The ``nodes`` row after ``event`` (``None`` when the event is not a node event)."""
    at = event.timestamp.isoformat()  # type: ignore[attr-defined]
    if isinstance(event, Node.Enrolled):
        return {
            "node_id": str(event.originator_id),
            "name": event.name,
            "state": event.state,
            "address": event.address,
            "rpc_port": event.rpc_port,
            "agent_version": event.agent_version,
            "labels": event.labels,
            "inventory": event.inventory,
            "resources": event.inventory,
            "local_models": [],
            #: Files it proved it holds: sha256 → {"basis", "claim"} (MODEL_PROVEN).
            "proven_models": {},
            #: Its claims refused: sha256 → {"file_name", "reason", "claim", "basis", "at"}.
            "refused_models": {},
            "slots": event.slots,
            "current_jobs": [],
            "runtime": None,
            #: When the node's last job ended (None while it holds one).
            "idle_since": at,
            "rpc_workers": {},
            "drain_requested": False,
            "drained": False,
            #: Its agent drains before it stops (NODE_STOPPING); rows stored before lack it.
            "stopping": False,
            "error": None,
            "security_violations": 0,
            "enrolled_at": at,
            "last_state_change": at,
            "last_event": code_of(event),
            "last_event_at": at,
            "version": event.originator_version,
        }
    if not isinstance(event, Node.Event) or row is None:
        return None
    new = dict(row)
    if event.state != row["state"]:
        new["state"] = event.state
        new["last_state_change"] = at
    new["last_event"] = code_of(event)
    new["last_event_at"] = at
    new["version"] = event.originator_version
    if isinstance(event, Node.ResourcesReported):
        new["resources"] = event.resources
        new["local_models"] = event.local_models
        new["proven_models"] = still_proven(row.get("proven_models") or {}, event.local_models)
        reported = {str(m.get("sha256")) for m in event.local_models}
        refused = row.get("refused_models") or {}
        new["refused_models"] = {k: v for k, v in refused.items() if k in reported}
    elif isinstance(event, Node.ModelProven):
        new["proven_models"] = {
            **(row.get("proven_models") or {}),
            event.sha256: {"basis": event.basis, "claim": event.claim},
        }
        refused = row.get("refused_models") or {}
        new["refused_models"] = {k: v for k, v in refused.items() if k != event.sha256}
    elif isinstance(event, Node.ModelClaimRefused):
        proven = row.get("proven_models") or {}
        new["proven_models"] = {k: v for k, v in proven.items() if k != event.sha256}
        new["refused_models"] = {
            **(row.get("refused_models") or {}),
            event.sha256: {
                "file_name": event.file_name,
                "reason": event.reason,
                "claim": event.claim,
                "basis": event.basis,
                "at": at,
            },
        }
    elif isinstance(event, Node.Stopping):
        new["stopping"] = True
    elif isinstance(event, Node.WentOffline | Node.Stopped | Node.ErrorReported | Node.Revoked):
        new["stopping"] = False
        new["current_jobs"] = []
        new["rpc_workers"] = {}
        new["runtime"] = None
        if isinstance(event, Node.ErrorReported):
            new["error"] = event.message
        if isinstance(event, Node.Revoked):
            new["revoked"] = True
            new["proven_models"] = {}
    elif isinstance(event, Node.Recovered):
        new["error"] = None
        new["runtime"] = None
        if event.agent_version:
            new["agent_version"] = event.agent_version
    elif isinstance(event, Node.DrainRequested):
        new["drain_requested"], new["drained"] = True, False
    elif isinstance(event, Node.Drained):
        new["drained"] = True
    elif isinstance(event, Node.Resumed):
        new["drain_requested"], new["drained"] = False, False
    elif isinstance(event, Node.RpcWorkerStarted):
        new["rpc_workers"] = {**row["rpc_workers"], event.job_id: f"{event.host}:{event.port}"}
    elif isinstance(event, Node.RpcWorkerStopped):
        new["rpc_workers"] = {k: v for k, v in row["rpc_workers"].items() if k != event.job_id}
    elif isinstance(event, Node.SecurityViolation):
        new["security_violations"] = row["security_violations"] + 1
    elif isinstance(event, Node.ModelTransferStarted):
        new["transfers"] = {
            **(row.get("transfers") or {}),
            event.transfer_id: {
                "sha256": event.sha256,
                "file_name": event.file_name,
                "size_bytes": event.size_bytes,
                "bytes_done": 0,
                "sources": event.sources,
                "started_at": at,
            },
        }
    elif isinstance(event, Node.ModelTransferProgressed):
        transfers = dict(row.get("transfers") or {})
        if event.transfer_id in transfers:
            transfer = {**transfers[event.transfer_id], "bytes_done": event.bytes_done}
            if event.size_bytes > 0:  # a URL's file: its size is known once it answers
                transfer["size_bytes"] = event.size_bytes
            transfers[event.transfer_id] = transfer
        new["transfers"] = transfers
    elif isinstance(event, Node.ModelTransferFailed):
        transfers = dict(row.get("transfers") or {})
        started = transfers.pop(event.transfer_id, None) or {}
        new["transfers"] = transfers
        new["transfer_failures"] = [
            transfer_failure(event.transfer_id, event.sha256, event.error, at, started),
            *(row.get("transfer_failures") or []),  # rows stored before the key lack it
        ][:TRANSFER_FAILURES_KEPT]
    elif isinstance(event, Node.ModelTransferCompleted):
        new["transfers"] = {
            k: v for k, v in (row.get("transfers") or {}).items() if k != event.transfer_id
        }
        failures = row.get("transfer_failures") or []
        if any(f["sha256"] == event.sha256 for f in failures):  # the node has the file now
            new["transfer_failures"] = [f for f in failures if f["sha256"] != event.sha256]
    elif isinstance(event, Node.RuntimeRetired):
        new["runtime"] = None
        new["rpc_workers"] = {}
    elif isinstance(event, Node.LinksMeasured):
        new["links"] = {peer: {**link, "measured_at": at} for peer, link in event.links.items()}
    elif isinstance(event, Node.JobAssigned):
        new["current_jobs"] = sorted({*row["current_jobs"], event.job_id})
        new["runtime"] = event.runtime
        new["idle_since"] = None
    elif isinstance(event, Node.JobReleased):
        new["current_jobs"] = [j for j in row["current_jobs"] if j != event.job_id]
        new["rpc_workers"] = {k: v for k, v in row["rpc_workers"].items() if k != event.job_id}
        if not new["current_jobs"]:
            new["idle_since"] = at
    return new


def eligibility_of(node: dict[str, Any]) -> dict[str, Any] | None:
    """The ``eligibility`` row of a node: what the scheduler reads (``None``: not eligible)."""
    jobs = len(node["current_jobs"])
    free_slots = runtime_capacity(node.get("runtime") if jobs else None, int(node["slots"])) - jobs
    if node["drain_requested"] or node.get("stopping") or free_slots <= 0:
        return None
    if node["state"] == NodeState.READY:
        fallback_only = False
    elif node["state"] == NodeState.DEGRADED:
        fallback_only = True
    else:
        return None
    return {
        "node_id": node["node_id"],
        "name": node["name"],
        "state": node["state"],
        "fallback_only": fallback_only,
        "address": node["address"],
        "rpc_port": node["rpc_port"],
        "free_slots": free_slots,
        "slots": int(node["slots"]),
        "jobs": jobs,
        "runtime_key": runtime_key(node.get("runtime")),
        "free_memory_bytes": _free_memory_bytes(node["resources"]),
        "local_models": sorted({str(m["sha256"]) for m in node["local_models"] if m.get("sha256")}),
        #: What the scheduler counts as there: files proven, by sha256 → the facts' basis.
        "proven_models": {
            sha: str(p.get("basis")) for sha, p in (node.get("proven_models") or {}).items()
        },
    }


def model_facts(
    model: dict[str, Any], nodes: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], str] | None:
    """A registered model's file facts (size and shape) and their basis, or None when none
    count: never known, or fixed by a node that has been revoked since (see
    domain/model_claims.py). ``nodes`` are node rows by id."""
    shape = model.get("shape") or model.get("stored")  # views older than "shape": the store's
    basis = model.get("shape_from") or (STORE if model.get("stored") else None)
    if not shape or not basis:
        return None
    if basis != STORE:
        fixer = nodes.get(basis)
        if fixer is None or fixer.get("revoked"):
            return None
    return facts_of(shape), str(basis)


def proves(node: dict[str, Any], sha256: str, basis: str) -> bool:
    """Whether the node (a row or an eligibility row) proved it holds the file against
    the facts of ``basis``."""
    proof = (node.get("proven_models") or {}).get(sha256)
    if isinstance(proof, dict):
        proof = proof.get("basis")
    return proof == basis


def proven_holders(
    model: dict[str, Any], nodes: dict[str, dict[str, Any]], states: frozenset[str]
) -> list[dict[str, Any]]:
    """The nodes in ``states`` (never a revoked one) that proved they hold the model's file."""
    facts = model_facts(model, nodes)
    if facts is None:
        return []
    return [
        n
        for n in nodes.values()
        if n["state"] in states and not n.get("revoked") and proves(n, model["sha256"], facts[1])
    ]


def project_job(row: dict[str, Any] | None, event: object) -> dict[str, Any] | None:
    """The ``jobs`` row after ``event`` (``None`` when the event is not a job event)."""
    at = event.timestamp.isoformat()  # type: ignore[attr-defined]
    if isinstance(event, Job.Submitted):
        return {
            "job_id": str(event.originator_id),
            "state": "SUBMITTED",
            "model": event.model,
            "stream": event.stream,
            "params": event.params,
            "message_count": event.message_count,
            "prompt_sha256": event.prompt_sha256,
            "controller": event.__dict__.get("controller", ""),  # absent in older events
            #: The API key it was asked with ("" in events recorded before keys).
            "key_id": event.__dict__.get("key_id", ""),
            "plan": None,
            "nodes": [],
            "replans": 0,
            "submitted_at": at,
            "queued_at": None,
            "queue_position": None,
            "planned_at": None,
            "dispatched_at": None,
            "route": None,
            "validated_at": None,
            "first_token_at": None,
            "ended_at": None,
            "chunks": 0,
            "tokens_streamed": 0,
            "text": "" if event.messages is not None else None,
            "finish_reason": None,
            "prompt_tokens": None,
            "completion_tokens": None,
            "time_to_first_token_ms": None,
            "tokens_per_second": None,
            "cached_prompt_tokens": None,
            "failure_phase": None,
            "failure_reason": None,
            "error_code": None,
            "last_event": code_of(event),
            "version": event.originator_version,
        }
    if not isinstance(event, Job.Event) or row is None:
        return None
    new = dict(row)
    new["state"] = event.resulting_state.value
    new["last_event"] = code_of(event)
    new["version"] = event.originator_version
    if isinstance(event, Job.Queued):
        new["queued_at"], new["queue_position"] = at, event.position
    elif isinstance(event, Job.Planned):
        new["plan"], new["planned_at"] = event.plan, at
    elif isinstance(event, Job.Replanned):
        new["plan"], new["replans"] = event.plan, row["replans"] + 1
    elif isinstance(event, Job.Dispatched):
        new["nodes"], new["dispatched_at"] = list(event.nodes), at
        new["route"] = event.route
    elif isinstance(event, Job.SetupValidated):
        new["validated_at"] = at
    elif isinstance(event, Job.TokenStreamChunk):
        new["chunks"] = row["chunks"] + 1
        new["tokens_streamed"] = row["tokens_streamed"] + event.token_count
        new["first_token_at"] = row["first_token_at"] or at
        if row["text"] is not None:
            new["text"] = row["text"] + "".join(str(d.get("text", "")) for d in event.deltas)
    elif isinstance(event, Job.Completed):
        new.update(
            ended_at=at,
            finish_reason=event.finish_reason,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            time_to_first_token_ms=event.time_to_first_token_ms,
            tokens_per_second=event.tokens_per_second,
            cached_prompt_tokens=event.cached_prompt_tokens,
        )
    elif isinstance(event, Job.Failed | Job.Rejected):
        # A rejection is the client's error: no phase of the job's run failed.
        if isinstance(event, Job.Failed):
            new["failure_phase"] = event.phase
        new.update(ended_at=at, failure_reason=event.reason, error_code=event.error_code)
    elif isinstance(event, Job.Cancelled):
        new.update(ended_at=at, failure_reason=event.reason, error_code="cancelled")
    return new


def project_model(row: dict[str, Any] | None, event: object) -> dict[str, Any] | None:
    """The ``models`` row after ``event`` (``None`` when not a model event)."""
    at = event.timestamp.isoformat()  # type: ignore[attr-defined]
    if isinstance(event, RegisteredModel.Registered):
        return {
            "name": event.name,
            "sha256": event.sha256,
            "file_name": event.file_name,
            "context_size": event.context_size,
            "kind": use_of(event)[0],
            "pooling": use_of(event)[1],
            "sources": [],
            "stored": None,
            #: The file's facts and their basis ("store" or the fixing node's id; None: not
            #: known yet). The samples stay in the event store.
            "shape": None,
            "shape_from": None,
            #: How many byte-range samples were recorded with the facts (0: none yet).
            "proof_samples": 0,
            "registered_at": at,
            "updated_at": at,
            "version": event.originator_version,
        }
    if row is not None and isinstance(event, RegisteredModel.Event):
        row = {**row, "version": event.originator_version}
    if isinstance(event, RegisteredModel.SourceAdded) and row is not None:
        return {**row, "sources": [*(row.get("sources") or []), event.url], "updated_at": at}
    if isinstance(event, RegisteredModel.SourceRemoved) and row is not None:
        sources = [u for u in row.get("sources") or [] if u != event.url]
        return {**row, "sources": sources, "updated_at": at}
    if isinstance(event, RegisteredModel.Stored) and row is not None:
        shape = shape_of(event)
        return {
            **row,
            "stored": shape,
            "shape": shape,
            "shape_from": STORE,
            "proof_samples": 0,
            "updated_at": at,
        }
    if isinstance(event, RegisteredModel.ShapeFixed) and row is not None:
        return {
            **row,
            "shape": shape_of(event),
            "shape_from": event.source,
            "proof_samples": len(event.samples),
            "updated_at": at,
        }
    if isinstance(event, RegisteredModel.Unstored) and row is not None:
        return {**row, "stored": None, "updated_at": at}
    if isinstance(event, RegisteredModel.Updated) and row is not None:
        changed = event.sha256 != row.get("sha256")
        return {
            **row,
            "stored": None if changed else row.get("stored"),
            "shape": None if changed else row.get("shape"),
            "shape_from": None if changed else row.get("shape_from"),
            "proof_samples": 0 if changed else row.get("proof_samples", 0),
            "sha256": event.sha256,
            "file_name": event.file_name,
            "context_size": event.context_size,
            "kind": use_of(event)[0],
            "pooling": use_of(event)[1],
            "updated_at": at,
        }
    return None


def project_refusal(row: dict[str, Any] | None, event: object) -> dict[str, Any] | None:
    """The ``refusals`` row of an ACCESS_REFUSED (each refusal is an aggregate of one event)."""
    if not isinstance(event, AccessRefusal.Refused):
        return row
    return {
        "refusal_id": str(event.originator_id),
        "at": event.timestamp.isoformat(),
        "kind": event.kind,
        "source": event.source,
        "node_name": event.node_name,
        "node_id": event.node_id,
        "reason": event.reason,
        "security_violation": event.security_violation,
        "suppressed": event.suppressed,
    }


def project_token(row: dict[str, Any] | None, event: object) -> dict[str, Any] | None:
    """The ``tokens`` row of an enrollment token minted (and perhaps revoked) through dacp."""
    at = event.timestamp.isoformat()  # type: ignore[attr-defined]
    if isinstance(event, IssuedToken.Minted):
        return {
            "token_id": event.token_id,
            "minted_at": at,
            "minted_by": event.minted_by,
            "expires_at": event.expires_at,
            "single_use": event.single_use,
            "node_name": event.node_name,
            "revoked": False,
            "revoked_at": None,
            "revoked_by": None,
        }
    if isinstance(event, IssuedToken.Revoked) and row is not None:
        return {**row, "revoked": True, "revoked_at": at, "revoked_by": event.revoked_by}
    return row


def project_api_key(row: dict[str, Any] | None, event: object) -> dict[str, Any] | None:
    """The ``api_keys`` row of a managed key: its terms and whether it was revoked; never its
    hash (nor, of course, the key)."""
    at = event.timestamp.isoformat()  # type: ignore[attr-defined]
    if isinstance(event, ApiKey.Created):
        return {
            "id": str(event.originator_id),
            "name": event.name,
            "owner": event.owner,
            "models": event.models,
            "limits": event.limits,
            "priority": event.priority,
            "expires_at": event.expires_at,
            "created_at": at,
            "updated_at": at,
            "revoked": False,
            "revoked_at": None,
            "revoked_by": None,
            "revoke_reason": None,
        }
    if row is None:
        return None
    if isinstance(event, ApiKey.Changed):
        changed = {k: v for k, v in event.changes.items() if k in CHANGEABLE}
        return {**row, **changed, "updated_at": at}
    if isinstance(event, ApiKey.Revoked):
        return {
            **row,
            "revoked": True,
            "revoked_at": at,
            "revoked_by": event.revoked_by,
            "revoke_reason": event.reason,
            "updated_at": at,
        }
    return None
