"""An aggregate's history for operators: its events in order, and its state at any point.

Shared by ``dacp events`` / ``dacp replay`` / ``dacp diagnose`` and the admin API, so the
terminal and the HTTP views of an incident always agree. Everything here reads the event
store; nothing is written.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from enum import Enum
from typing import Any
from uuid import UUID

from eventsourcing.application import Application
from eventsourcing.domain import Aggregate

from application.read_models import project_job
from domain.access_refusal import AccessRefusal
from domain.catalog import code_of
from domain.context_window import slot_context
from domain.job import Job
from domain.model import RegisteredModel
from domain.node import Node

#: Event fields that every entry already shows on its own (or that are plumbing).
_ENVELOPE = frozenset({"originator_id", "originator_version", "timestamp", "originator_topic"})
#: Fields never shown, even to an administrator (a hash of a node's credential or of an API key).
_REDACTED = frozenset({"credential_sha256", "key_sha256"})

Entry = dict[str, Any]


# ------------------------------------------------------------------ JSON safety


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON types: UUIDs and times as strings, tuples and sets as lists."""
    if isinstance(value, Enum):
        return json_safe(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(json_safe(v) for v in value)
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_safe(dataclasses.asdict(value))
    return str(value)


def iso(moment: datetime) -> str:
    """ISO 8601 in UTC (naive times are taken to be UTC already)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat()


def parse_time(text: str) -> datetime:
    """An ISO 8601 time (``Z`` allowed; no zone means UTC); raises ``ValueError``."""
    raw = text.strip()
    if raw.endswith(("Z", "z")):
        raw = raw[:-1] + "+00:00"
    moment = datetime.fromisoformat(raw)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def payload_of(event: object) -> dict[str, Any]:
    """The event's own fields, JSON-safe, without the envelope and secrets."""
    fields = getattr(event, "__dict__", {})
    return {
        key: ("<redacted>" if key in _REDACTED else json_safe(value))
        for key, value in fields.items()
        if key not in _ENVELOPE
    }


# -------------------------------------------------------------------- summaries


def short(ident: object) -> str:
    """The first eight characters of an id: enough to tell nodes and jobs apart."""
    text = str(ident or "")
    return text[:8] if len(text) > 8 else text


def _gib(value: Any) -> str:
    return f"{int(value) / (1 << 30):.1f} GiB"


def _lost(jobs: Iterable[Any]) -> str:
    lost = [short(j) for j in jobs]
    return f"; lost jobs {', '.join(lost)}" if lost else ""


def _enrolled(p: Mapping[str, Any]) -> str:
    return (
        f"name={p.get('name')} address={p.get('address')}:{p.get('rpc_port')} "
        f"agent {p.get('agent_version')} slots={p.get('slots')}"
    )


def _resources(p: Mapping[str, Any]) -> str:
    res = p.get("resources") or {}
    parts = []
    if res.get("ram_free_bytes") is not None:
        parts.append(f"ram free {_gib(res['ram_free_bytes'])}")
    elif res.get("ram_total_bytes") is not None:
        parts.append(f"ram {_gib(res['ram_total_bytes'])}")
    gpus = res.get("gpus") or []
    parts.append(f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}")
    models = p.get("local_models") or []
    parts.append(f"{len(models)} local model{'s' if len(models) != 1 else ''}")
    return ", ".join(parts)


def _plan(plan: Mapping[str, Any] | None) -> str:
    if not plan:
        return "no plan"
    primary = plan.get("primary") or {}
    workers = plan.get("workers") or []
    split = plan.get("tensor_split") or []
    text = f"primary={short(primary.get('node_id'))} workers={len(workers)}"
    if workers:
        text += " [" + ", ".join(short(w.get("node_id")) for w in workers) + "]"
    if split:
        text += " split=" + "/".join(f"{float(s):g}" for s in split)
    if plan.get("context_size"):
        # What one slot holds, as llama.cpp sizes it: the context a job of the plan gets.
        text += f" ctx={slot_context(int(plan['context_size']))}/slot"
    if int(plan.get("parallel") or 1) > 1:
        text += f" x{plan['parallel']} slots"
    if plan.get("tier"):
        text += f" tier={plan['tier']}"
    devices = [d for d in plan.get("devices") or [] if isinstance(d, Mapping)]
    if devices:
        text += " devices=" + ", ".join(
            f"{short(d.get('node_id'))}:{d.get('device')} {100 * float(d.get('share') or 0):.1f}%"
            for d in devices
        )
    if plan.get("n_gpu_layers") is not None:
        text += f" gpu_layers={plan['n_gpu_layers']}"
    reasons = [str(r) for r in plan.get("reasons") or []]
    if reasons:
        text += " (" + "; ".join(reasons) + ")"
    return text


def _out_of_memory(oom: Mapping[str, Any] | None) -> str:
    if not oom:
        return ""
    asked = f", asked {oom.get('asked_bytes')} bytes" if oom.get("asked_bytes") else ""
    return (
        f"; out of memory on {short(oom.get('node_id'))}:{oom.get('device')} "
        f"(planned {oom.get('planned_bytes')} bytes{asked}), its budget lowered"
    )


def _submitted(p: Mapping[str, Any]) -> str:
    params = p.get("params") or {}
    text = (
        f"model={p.get('model')} messages={p.get('message_count')} "
        f"stream={'yes' if p.get('stream') else 'no'}"
    )
    if params.get("max_tokens") is not None:
        text += f" max_tokens={params['max_tokens']}"
    return text


def _chunk(p: Mapping[str, Any]) -> str:
    deltas = p.get("deltas") or []
    n = len(deltas)
    seqs = [int(d["seq"]) for d in deltas if "seq" in d]
    span = (
        f", seq {min(seqs)}-{max(seqs)}" if len(seqs) > 1 else (f", seq {seqs[0]}" if seqs else "")
    )
    tokens = p.get("token_count", 0)
    return f"{n} delta{'s' if n != 1 else ''}, {tokens} token{'s' if tokens != 1 else ''}{span}"


def _completed(p: Mapping[str, Any]) -> str:
    return (
        f"finish={p.get('finish_reason')} prompt={p.get('prompt_tokens')} "
        f"completion={p.get('completion_tokens')} "
        f"ttft={float(p.get('time_to_first_token_ms') or 0):.1f} ms "
        f"{float(p.get('tokens_per_second') or 0):.1f} tok/s"
    )


def _failed(p: Mapping[str, Any]) -> str:
    text = f"phase={p.get('phase')} reason={p.get('reason')}"
    if p.get("error_code"):
        text += f" (code {p['error_code']})"
    return text


def _violation(p: Mapping[str, Any]) -> str:
    text = f"peer {p.get('address')}: {p.get('reason')}"
    if p.get("job_id"):
        text += f" (job {short(p['job_id'])})"
    return text


def size_text(value: Any) -> str:
    """A byte count as people read it: ``512 B``, ``1.5 KiB``, ``100.0 MiB``, ``4.2 GiB``."""
    n = int(value or 0)
    if n < 1 << 10:
        return f"{n} B"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"  # unreachable


def source_text(source: Any) -> str:
    """Where a model file comes from: a node's short id, an http(s) URL without its query
    (which may hold a token) and fragment, or any other source's name as it is."""
    text = str(source or "")
    if "://" in text:
        return text.split("#", 1)[0].split("?", 1)[0]
    return short(text) if as_uuid(text) is not None else text


def transfer_progress_text(bytes_done: Any, size_bytes: Any) -> str:
    """``25% (25.0 MiB of 100.0 MiB)``, or ``12.0 MiB (size unknown)`` when the size is 0."""
    done, size = int(bytes_done or 0), int(size_bytes or 0)
    if size <= 0:
        return f"{size_text(done)} (size unknown)"
    return f"{min(100, done * 100 // size)}% ({size_text(done)} of {size_text(size)})"


def _transfer_tag(p: Mapping[str, Any]) -> str:
    """`` [transfer 1a2b3c4d]``: ties a transfer's events together."""
    return f" [transfer {short(p['transfer_id'])}]" if p.get("transfer_id") else ""


def _transfer_started(p: Mapping[str, Any]) -> str:
    size = int(p.get("size_bytes") or 0)
    sources = [source_text(s) for s in p.get("sources") or []]
    return (
        f"fetching {p.get('file_name')} ({size_text(size) if size > 0 else 'size unknown'}) "
        f"from {', then '.join(sources) or 'nowhere'}{_transfer_tag(p)}"
    )


def _transfer_progress(p: Mapping[str, Any]) -> str:
    text = transfer_progress_text(p.get("bytes_done"), p.get("size_bytes"))
    return f"fetched {text}{_transfer_tag(p)}"


SUMMARIES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "NODE_ENROLLED": _enrolled,
    "NODE_READY": lambda p: f"ready ({p.get('state')})",
    "RESOURCES_REPORTED": _resources,
    "HEARTBEAT_TIMEOUT": lambda p: (
        f"no heartbeat for {float(p.get('seconds_since_last') or 0):.1f} s"
    ),
    "NODE_OFFLINE": lambda p: f"{p.get('reason')}{_lost(p.get('lost_jobs') or [])}",
    "NODE_STOPPING": lambda p: (
        f"stopping (drain): {len(p.get('running_jobs') or [])} job(s) running, "
        f"at most {float(p.get('drain_timeout_seconds') or 0):g} s"
    ),
    "NODE_STOPPED": lambda p: (
        f"stopped with jobs running: {p.get('reason')}{_lost(p['lost_jobs'])}"
        if p.get("lost_jobs")
        else f"stopped cleanly ({p.get('reason')})"
    ),
    "NODE_RECOVERED": lambda p: (
        f"recovered, agent {p['agent_version']}" if p.get("agent_version") else "recovered"
    ),
    "NODE_DRAIN_REQUESTED": lambda p: f"drain requested by {p.get('requested_by')}",
    "NODE_DRAINED": lambda p: "drained: no job left",
    "NODE_RESUMED": lambda p: f"resumed by {p.get('requested_by')}",
    "NODE_ERROR": lambda p: f"{p.get('message')}{_lost(p.get('lost_jobs') or [])}",
    "ACCESS_REFUSED": lambda p: (
        f"{'enrollment' if p.get('kind') == 'enroll' else 'control stream'} from "
        f"{p.get('source')} refused"
        + (" (security violation)" if p.get("security_violation") else "")
        + f": {p.get('reason')}"
        + (f"; {p.get('suppressed')} more not recorded" if p.get("suppressed") else "")
    ),
    "NODE_REVOKED": lambda p: (
        f"revoked by {p.get('revoked_by')}: {p.get('reason')}{_lost(p.get('lost_jobs') or [])}"
    ),
    "RPC_WORKER_STARTED": lambda p: (
        f"job {short(p.get('job_id'))} worker at {p.get('host')}:{p.get('port')}"
    ),
    "RPC_WORKER_STOPPED": lambda p: f"job {short(p.get('job_id'))}: {p.get('reason')}",
    "MODEL_TRANSFER_STARTED": _transfer_started,
    "MODEL_TRANSFER_PROGRESS": _transfer_progress,
    "MODEL_TRANSFER_COMPLETED": lambda p: (
        f"model {str(p.get('sha256'))[:12]} fetched"
        + (f" from {source_text(p['source_node_id'])}" if p.get("source_node_id") else "")
        + _transfer_tag(p)
    ),
    "MODEL_TRANSFER_FAILED": lambda p: (
        f"fetching model {str(p.get('sha256'))[:12]} failed: {p.get('error')}{_transfer_tag(p)}"
    ),
    "MODEL_EVICTED": lambda p: f"model file {p.get('file_name')} deleted (evicted)",
    "MODEL_PROVEN": lambda p: (
        f"proved it holds model file {str(p.get('sha256'))[:12]} (facts from {p.get('basis')})"
    ),
    "MODEL_CLAIM_REFUSED": lambda p: (
        f"its claim of model file {p.get('file_name')} ({str(p.get('sha256'))[:12]}) "
        f"refused: {p.get('reason')}"
    ),
    "NODE_RUNTIME_RETIRED": lambda p: (
        f"runtime {p.get('runtime_key')} retired after {p.get('idle_seconds')} s idle"
    ),
    "SECURITY_VIOLATION": _violation,
    "NODE_MESSAGE_REJECTED": lambda p: (
        f"{p.get('kind')} rejected"
        + (f" (job {short(p.get('job_id'))})" if p.get("job_id") else "")
        + f": {p.get('reason')}"
        + (f"; {p.get('suppressed')} more not recorded" if p.get("suppressed") else "")
    ),
    "NODE_JOB_ASSIGNED": lambda p: f"job {short(p.get('job_id'))} as {p.get('role')}",
    "NODE_JOB_RELEASED": lambda p: f"job {short(p.get('job_id'))} {p.get('outcome')}",
    "JOB_SUBMITTED": _submitted,
    "JOB_PLANNED": lambda p: _plan(p.get("plan")),
    "JOB_REPLANNED": lambda p: (
        f"{_plan(p.get('plan'))}; because {p.get('reason')}"
        + (f"; excluded {short(p['excluded_node'])}" if p.get("excluded_node") else "")
        + _out_of_memory(p.get("out_of_memory"))
    ),
    "JOB_DISPATCHED": lambda p: "nodes " + ", ".join(short(n) for n in p.get("nodes") or []),
    "JOB_SETUP_VALIDATED": lambda p: "setup validated; execution starts",
    "TOKEN_STREAM_CHUNK": _chunk,
    "JOB_COMPLETED": _completed,
    "JOB_FAILED": _failed,
    "JOB_CANCELLED": lambda p: f"reason={p.get('reason')}",
    "JOB_REJECTED": lambda p: f"the client's error ({p.get('error_code')}): {p.get('reason')}",
    "MODEL_REGISTERED": lambda p: (
        f"{p.get('name')} = {p.get('file_name')} sha256 {str(p.get('sha256'))[:12]}..."
    ),
    "MODEL_UPDATED": lambda p: f"{p.get('file_name')} sha256 {str(p.get('sha256'))[:12]}...",
    "MODEL_SHAPE_FIXED": lambda p: (
        f"facts fixed from {p.get('source')}: {p.get('size_bytes')} bytes, {p.get('layers')} "
        f"layers, {len(p.get('samples') or [])} samples"
    ),
}


def summarize(code: str, payload: Mapping[str, Any]) -> str:
    """One line about an event, by catalog code (``key=value`` pairs for unknown codes)."""
    fn = SUMMARIES.get(code)
    if fn is not None:
        try:
            return fn(payload)
        except (KeyError, TypeError, ValueError):
            pass  # a malformed payload still gets the generic line below
    return " ".join(f"{k}={v}" for k, v in payload.items() if not isinstance(v, dict | list))


# --------------------------------------------------------------------- timeline


def aggregate_kind(event: object) -> str:
    """``node``, ``job``, ``model``, ``access`` (a refused attempt to get in) or ``other``,
    from an aggregate's first event."""
    if isinstance(event, AccessRefusal.Refused):
        return "access"
    if isinstance(event, Node.Enrolled | Node.Event):
        return "node"
    if isinstance(event, Job.Submitted | Job.Event):
        return "job"
    if isinstance(event, RegisteredModel.Registered | RegisteredModel.Event):
        return "model"
    return "other"


def entry_of(event: object, position: int | None = None) -> Entry:
    """One timeline row: position, time, code, version, resulting state, summary, payload."""
    code = code_of(event)
    payload = payload_of(event)
    state = getattr(event, "state", None)
    if state is None:
        resulting = getattr(type(event), "resulting_state", None)
        state = resulting.value if isinstance(resulting, Enum) else None
    return {
        "position": position,
        "time": iso(event.timestamp),  # type: ignore[attr-defined]
        "code": code,
        "version": int(event.originator_version),  # type: ignore[attr-defined]
        "state": json_safe(state),
        "summary": summarize(code, payload),
        "payload": payload,
    }


#: The ids the OpenAI API gives a job's answer: a prefix, then the job id's 32 hex digits.
CHAT_COMPLETION_ID_PREFIX = "chatcmpl-"
COMPLETION_ID_PREFIX = "cmpl-"
#: The shortest abbreviation of a job id a person may type (``short`` shows eight).
MIN_JOB_PREFIX = 4
_HEX = re.compile(r"[0-9a-f]+")
_DASHES_AT = (8, 12, 16, 20)  # in the 32 hex digits: where the dashed form has its dashes


def answer_id(prefix: str, job_id: str) -> str:
    """``chatcmpl-…``/``cmpl-…``: what the OpenAI API calls the answer of job ``job_id``."""
    return prefix + job_id.replace("-", "")


def job_id_forms(ident: str) -> tuple[UUID | None, str | None]:
    """What a person may type for a job: its full id, the ``chatcmpl-``/``cmpl-`` id an SDK
    returned (the full id), or its short id or any longer beginning (a prefix of the dashed id,
    typed with or without dashes). ``(uuid, None)``, ``(None, prefix)`` or ``(None, None)``."""
    text = ident.strip().lower()
    for prefix in (CHAT_COMPLETION_ID_PREFIX, COMPLETION_ID_PREFIX):
        text = text.removeprefix(prefix)
    uid = as_uuid(text)
    if uid is not None:
        return uid, None
    digits = text.replace("-", "")
    if not MIN_JOB_PREFIX <= len(digits) < 32 or not _HEX.fullmatch(digits):
        return None, None
    dashed = "".join(("-" if i in _DASHES_AT else "") + c for i, c in enumerate(digits))
    return None, dashed


def as_uuid(ident: UUID | str) -> UUID | None:
    if isinstance(ident, UUID):
        return ident
    try:
        return UUID(str(ident).strip())
    except ValueError:
        return None


def events_of(
    app: Application[UUID], aggregate_id: UUID | str, lte: int | None = None
) -> list[Any]:
    """The aggregate's domain events in version order (``[]`` when there are none)."""
    uid = as_uuid(aggregate_id)
    if uid is None:
        return []
    return list(app.repository.event_store.get(uid, lte=lte))


def positions(app: Application[UUID], aggregate_id: UUID | str) -> dict[int, int]:
    """Version → notification-log position of the aggregate's events; ``{}`` if unknown.

    One indexed query on the events table (eventsourcing has no public call for it);
    positions are an aid for correlating aggregates, so any surprise just omits them.
    """
    uid = as_uuid(aggregate_id)
    recorder: Any = app.recorder
    table = getattr(recorder, "events_table_name", None)
    datastore = getattr(recorder, "datastore", None)
    if uid is None or not table or datastore is None:
        return {}
    schema = getattr(datastore, "schema", None)
    if schema is not None:  # Postgres
        statement = (
            f'SELECT notification_id AS position, originator_version FROM "{schema}"."{table}" '
            "WHERE originator_id = %s"
        )
        params: tuple[Any, ...] = (uid,)
    else:  # SQLite: the rowid is the notification id
        statement = (
            f"SELECT rowid AS position, originator_version FROM {table} WHERE originator_id = ?"
        )
        params = (uid.hex,)
    try:
        with datastore.transaction(commit=False) as c:
            c.execute(statement, params)
            return {int(r["originator_version"]): int(r["position"]) for r in c.fetchall()}
    except Exception:
        return {}


def timeline(app: Application[UUID], aggregate_id: UUID | str) -> list[Entry]:
    """Every event of the aggregate, oldest first, as JSON-safe rows (``[]``: unknown id)."""
    events = events_of(app, aggregate_id)
    if not events:
        return []
    where = positions(app, aggregate_id)
    return [entry_of(e, where.get(int(e.originator_version))) for e in events]


def _plan_nodes(plan: Mapping[str, Any] | None) -> list[str]:
    if not plan:
        return []
    nodes = [plan.get("primary", {}).get("node_id")]
    nodes += [w.get("node_id") for w in plan.get("workers", [])]
    return [str(n) for n in nodes if n]


def job_timeline(app: Application[UUID], job_id: UUID | str) -> list[Entry]:
    """A job's own events plus the node events about it (RPC workers started for it, its
    slots taken and freed), in store order: the whole story of one job."""
    own = timeline(app, job_id)
    if not own:
        return []
    for entry in own:
        entry["aggregate_id"] = str(job_id)
    nodes: list[str] = []
    for entry in own:
        payload = entry["payload"]
        for node_id in [*_plan_nodes(payload.get("plan")), *payload.get("nodes", [])]:
            if node_id not in nodes:
                nodes.append(node_id)
    related: list[Entry] = []
    for node_id in nodes:
        where = positions(app, node_id)
        for event in events_of(app, node_id):
            if getattr(event, "job_id", None) == str(job_id):
                entry = entry_of(event, where.get(int(event.originator_version)))
                entry["aggregate_id"] = node_id
                related.append(entry)
    merged = own + related
    merged.sort(key=lambda e: (e["position"] is None, e["position"] or 0, e["time"]))
    return merged


def timeline_kind(app: Application[UUID], aggregate_id: UUID | str) -> str | None:
    """What the aggregate is (``node``, ``job``, …) or ``None`` when it has no events."""
    uid = as_uuid(aggregate_id)
    if uid is None:
        return None
    first = list(app.repository.event_store.get(uid, limit=1))
    return aggregate_kind(first[0]) if first else None


# ----------------------------------------------------------------------- replay


class ReplayError(ValueError):
    """The requested point lies outside the aggregate's history."""


def fold(events: Iterable[Any]) -> Aggregate | None:
    """The aggregate the events build, applied one by one from nothing."""
    aggregate: Any = None
    for event in events:
        aggregate = event.mutate(aggregate)
    return aggregate  # type: ignore[no-any-return]


def replay(
    app: Application[UUID],
    aggregate_id: UUID | str,
    *,
    version: int | None = None,
    at: datetime | None = None,
) -> tuple[Aggregate, list[Any]]:
    """The aggregate as of ``version`` or time ``at`` (default: now), with the events used.

    Raises :class:`ReplayError` when the point precedes the aggregate's creation.
    """
    if version is not None and version < 1:
        raise ReplayError("versions start at 1")
    events = events_of(app, aggregate_id, lte=version)
    if at is not None:
        at = at if at.tzinfo else at.replace(tzinfo=UTC)
        events = [e for e in events if e.timestamp <= at]
        if not events:
            raise ReplayError(f"it did not exist yet at {iso(at)}")
    if not events:
        raise ReplayError("it has no events")
    aggregate = fold(events)
    assert aggregate is not None
    return aggregate, events


def job_row(app: Application[UUID], job_id: UUID | str) -> dict[str, Any] | None:
    """The job's read-model row computed straight from its events (never stale)."""
    row: dict[str, Any] | None = None
    for event in events_of(app, job_id):
        row = project_job(row, event)
    return row


def state_of(aggregate: Aggregate) -> dict[str, Any]:
    """The aggregate's public attributes, JSON-safe, with id, version and times first."""
    out: dict[str, Any] = {
        "id": str(aggregate.id),
        "kind": type(aggregate).__name__.lower(),
        "version": aggregate.version,
        "created_on": iso(aggregate.created_on),
        "modified_on": iso(aggregate.modified_on),
    }
    for key, value in vars(aggregate).items():
        if key.startswith("_"):
            continue
        out[key] = "<redacted>" if key in _REDACTED else json_safe(value)
    return out
