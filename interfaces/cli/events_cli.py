"""``dacp events | replay | diagnose | projections``: operating on the event store directly.

These read the store named by ``--database-url`` or ``DATABASE_URL`` (unset: the embedded
SQLite file ``var/dacp.sqlite3``, or ``$DACP_VAR_DIR/dacp.sqlite3``, like the controller),
whether or not a controller is running. Only ``projections rebuild`` writes, and only to
read-model views. Errors end with exit code 2 and one line on stderr, nothing on stdout.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import orjson
import psycopg
from eventsourcing.persistence import PersistenceError

from application.close_names import suggestion
from application.diagnosis import diagnose
from application.timeline import (
    ReplayError,
    as_uuid,
    entry_of,
    events_of,
    iso,
    job_id_forms,
    job_row,
    job_timeline,
    parse_time,
    positions,
    replay,
    state_of,
    timeline,
    timeline_kind,
)
from application.version import CONTROLLER_VERSION
from infrastructure.persistence import DEFAULT_SQLITE_FILE, persistence_env
from infrastructure.projection_follower import rebuild
from infrastructure.read_model_store import ReadModelStore, open_read_model
from infrastructure.settings import SettingsError
from infrastructure.storage import Storage, open_storage

#: How many of the latest jobs an unknown job id is compared with (for the closest ones).
SUGGEST_FROM_JOBS = 1000
#: How many of a node's recent jobs ``diagnose`` looks at.
DIAGNOSE_JOBS = 20
#: The shadow views ``projections rebuild`` builds beside the live ones.
SHADOW_VIEW = "dacp_rebuild"
#: How many differing rows per view ``projections rebuild`` names.
DIFF_EXAMPLES = 5


class Refusal(Exception):
    """A one-line message for the user; exit code 2."""


# ----------------------------------------------------------------- plumbing


def _emit_json(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


def store_env(database_url: str | None) -> dict[str, str]:
    """The eventsourcing environment of an existing store (never creates an SQLite file), as
    the configuration names it (said on stderr)."""
    from interfaces.cli.cli_target import load_cli_env

    try:
        cli_env = load_cli_env()
        settings = cli_env.settings()
    except SettingsError as e:
        raise Refusal(str(e)) from e
    url = database_url or settings.database_url
    var_dir = settings.var_dir
    cli_env.using_store(database_url)
    if not url:
        path = var_dir / DEFAULT_SQLITE_FILE
        if not path.is_file():
            raise Refusal(
                f"no event store at {path}: no controller has run with this DACP_VAR_DIR "
                f"(set DATABASE_URL, DACP_VAR_DIR or DACP_CONFIG, or pass --database-url)"
            )
        return persistence_env(None, var_dir=var_dir)
    try:
        env = persistence_env(url, var_dir=var_dir, pool_size=2)
    except SettingsError as e:
        raise Refusal(str(e)) from e
    sqlite_file = env.get("SQLITE_DBNAME")
    if sqlite_file and not Path(sqlite_file).is_file():
        raise Refusal(f"no event store at {sqlite_file}")
    return env


@contextmanager
def opened(args: argparse.Namespace) -> Iterator[Storage]:
    """The store's application and live views (no follower runs)."""
    storage = open_storage(store_env(args.database_url))
    try:
        yield storage
    finally:
        storage.close()


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turns refusals and store failures into one stderr line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except Refusal as e:
            message = str(e)
        except (PersistenceError, psycopg.Error, sqlite3.Error, OSError) as e:
            message = f"cannot read the event store: {' '.join(str(e).split())}"
        print(f"dacp: {message}", file=sys.stderr)
        return 2

    return run


def resolve(storage: Storage, ident: str, kind: str) -> UUID:
    """The id of the node (by id or name) or job that ``ident`` names: a job by its full id,
    its short id (or any longer beginning) or the ``chatcmpl-``/``cmpl-`` id of its answer."""
    uid = as_uuid(ident)
    if kind == "job":
        uid, prefix = job_id_forms(ident)
        if prefix is not None:
            begun = storage.read_model.job_ids_starting(prefix, 6)
            if len(begun) == 1:
                return UUID(begun[0])
            if len(begun) > 1:
                more = ", …" if len(begun) > 5 else ""
                raise Refusal(
                    f"several jobs begin with {ident}; type more of the id: "
                    f"{', '.join(begun[:5])}{more}"
                )
    if uid is not None:
        found = timeline_kind(storage.app, uid)
        if found == kind:
            return uid
        if found is not None:
            raise Refusal(f"{ident} is a {found}, not a {kind}")
    if kind == "node" and uid is None:
        matches = [r for r in storage.read_model.list_nodes() if r.get("name") == ident]
        if len(matches) == 1:
            return UUID(str(matches[0]["node_id"]))
        if len(matches) > 1:
            ids = ", ".join(str(m["node_id"]) for m in matches)
            raise Refusal(f"several nodes are named {ident}; use an id: {ids}")
    raise Refusal(f"unknown {kind} {ident}{suggestion(kind, ident, known(storage, kind, uid))}")


def known(storage: Storage, kind: str, uid: UUID | None) -> list[str]:
    """What an unknown ``kind`` is compared with: node names (ids, for an id), or the ids of
    the latest :data:`SUGGEST_FROM_JOBS` jobs."""
    if kind == "job":
        return [str(r["job_id"]) for r in storage.read_model.list_jobs(limit=SUGGEST_FROM_JOBS)]
    key = "name" if uid is None else "node_id"
    return [str(r[key]) for r in storage.read_model.list_nodes() if r.get(key)]


# ------------------------------------------------------------------- tables


def table_time(text: str) -> str:
    """A timeline time, shortened to milliseconds: ``2025-01-02T03:04:05.678Z``."""
    try:
        moment = parse_time(text)
    except ValueError:
        return text
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns; the last one is not padded."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in [list(headers), *rows]:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def timeline_table(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = [
        [
            "" if e.get("position") is None else str(e["position"]),
            table_time(str(e["time"])),
            str(e["version"]),
            str(e["code"]),
            str(e.get("state") or ""),
            str(e.get("summary") or ""),
        ]
        for e in entries
    ]
    return format_table(["POS", "TIME (UTC)", "VER", "EVENT", "STATE", "SUMMARY"], rows)


# ----------------------------------------------------------------- commands


@_guarded
def cmd_events(args: argparse.Namespace) -> int:
    with opened(args) as storage:
        uid = resolve(storage, args.ident, args.kind)
        entries = (job_timeline if args.kind == "job" else timeline)(storage.app, uid)
    if args.json:
        _emit_json(entries)
    else:
        print("\n".join(timeline_table(entries)))
    return 0


@_guarded
def cmd_replay(args: argparse.Namespace) -> int:
    at = None
    if args.at is not None:
        try:
            at = parse_time(args.at)
        except ValueError as e:
            raise Refusal(f"--at must be an ISO 8601 time, got {args.at!r}") from e
    with opened(args) as storage:
        uid = resolve(storage, args.ident, args.kind)
        latest = events_of(storage.app, uid)[-1].originator_version
        if args.version is not None and args.version > latest:
            raise Refusal(f"{args.kind} {args.ident} has only {latest} versions")
        try:
            aggregate, used = replay(storage.app, uid, version=args.version, at=at)
        except ReplayError as e:
            raise Refusal(f"cannot replay {args.kind} {args.ident}: {e}") from e
        last = used[-1]
        where = positions(storage.app, uid)
    state = state_of(aggregate)
    state["as_of"] = {
        "version": aggregate.version,
        "latest_version": latest,
        "time": iso(last.timestamp),
        "position": where.get(int(last.originator_version)),
        "event": entry_of(last)["code"],
        "requested": {"version": args.version, "at": iso(at) if at else None},
    }
    _emit_json(state)
    return 0


def node_job_ids(storage: Storage, node_id: UUID, events: Sequence[Mapping[str, Any]]) -> list[str]:
    """The node's recent jobs: the read model's and those its own events name."""
    ids: dict[str, None] = {}
    for entry in reversed(events):
        payload = entry.get("payload") or {}
        named = [payload.get("job_id"), *(payload.get("lost_jobs") or [])]
        for job_id in named:
            if job_id:
                ids.setdefault(str(job_id), None)
    rows = storage.read_model.list_jobs(node_id=str(node_id), limit=DIAGNOSE_JOBS)
    for row in rows:
        ids.setdefault(str(row["job_id"]), None)
    return list(ids)[: DIAGNOSE_JOBS * 2]


@_guarded
def cmd_diagnose(args: argparse.Namespace) -> int:
    with opened(args) as storage:
        try:
            uid = resolve(storage, args.ident, "node")
        except Refusal:
            # No such node; perhaps it never got in: its refused attempts say why.
            refused = storage.read_model.list_refusals(node_id=args.ident, node_name=args.ident)
            if refused:
                print("\n".join(refusals_text(refused)))
            raise
        events = timeline(storage.app, uid)
        node = state_of(storage.app.get_node(uid))
        node["node_id"] = str(uid)
        job_ids = node_job_ids(storage, uid, events)
        jobs = [row for job_id in job_ids if (row := job_row(storage.app, job_id)) is not None]
        skips = storage.read_model.list_skips([str(uid), *job_ids])
        refused = storage.read_model.list_refusals(node_id=str(uid), node_name=node["name"])
    jobs.sort(key=lambda r: str(r.get("submitted_at") or ""), reverse=True)
    report = diagnose(
        node,
        events,
        jobs[:DIAGNOSE_JOBS],
        CONTROLLER_VERSION,
        recent=args.recent,
        skips=skips,
        refusals=refused,
    )
    if args.json:
        _emit_json(report)
    else:
        print("\n".join(diagnosis_text(report)))
    return 0


def refusals_text(refused: Sequence[Mapping[str, Any]]) -> list[str]:
    """Refused enrollments and streams under a node's name or id, newest first."""
    lines = ["refused attempts (newest first):"]
    for r in refused:
        what = "enrollment" if r["kind"] == "enroll" else "control stream"
        more = f" (+{r['suppressed']} more)" if r.get("suppressed") else ""
        flag = " SECURITY VIOLATION" if r.get("security_violation") else ""
        lines.append(f"  {table_time(str(r['at']))} {what} from {r['source']}{flag}{more}")
        lines.append(f"    reason: {r['reason']}")
    return lines


def _exit_text(exit_: Mapping[str, Any] | None) -> str:
    """How the node last left service: stopped cleanly, stopped with jobs lost, or lost."""
    if not exit_:
        return "-"
    how = str(exit_["how"])
    if exit_["code"] == "NODE_OFFLINE":
        how += " (no goodbye: a crash, a kill or the network)"
    return f"{how} at {table_time(str(exit_.get('time')))}: {exit_.get('reason') or '-'}"


def diagnosis_text(report: Mapping[str, Any]) -> list[str]:
    lines = format_table(
        ["", ""],
        [
            ["node", f"{report['name']}  ({report['node_id']})"],
            ["address", str(report.get("address") or "-")],
            ["agent version", str(report.get("agent_version") or "-")],
            ["controller version", str(report["controller_version"])],
            [
                "state",
                f"{report['state']}  (since {table_time(str(report.get('last_state_change')))})",
            ],
            ["drain requested", "yes" if report.get("drain_requested") else "no"],
            ["error", str(report.get("error") or "-")],
            ["last stop", _exit_text(report.get("last_exit"))],
            [
                "failures",
                f"{report['failure_pattern']}: {report['failures_before_execution']} before, "
                f"{report['failures_during_execution']} during execution "
                f"(of {report['jobs_considered']} recent jobs)",
            ],
        ],
    )[1:]
    lines.append("")
    lines.append("findings:" if report["findings"] else "findings: none")
    for f in report["findings"]:
        times = f"x{f['count']}, last {table_time(str(f['last_time']))}"
        lines.append(f"  {f['code']} ({times}): {f['summary']}")
        lines.append(f"    check: {f['check']}")
    transfers = report.get("transfers") or []
    if transfers:
        lines.append("")
        lines.append("model transfers (newest first):")
        for t in transfers:
            lines.append(f"  {table_time(str(t['started_at']))} {t['line']}")
    lines.append("")
    lines.append("failed jobs:" if report["failed_jobs"] else "failed jobs: none")
    for j in report["failed_jobs"]:
        lines.append(
            f"  {j['job_id']}  {j['model']}  failed {j['when']}"
            f"  at {table_time(str(j['failed_at']))}"
        )
        lines.append(
            f"    reason: {j['reason']}" + (f" ({j['error_code']})" if j["error_code"] else "")
        )
        lines.append(f"    check:  {j['check']}")
    refused = report.get("access_refused") or []
    if refused:
        lines.append("")
        lines.extend(refusals_text(refused))
    skips = report.get("read_model_skips") or []
    if skips:
        lines.append("")
        lines.append(
            "read model: skipped events of this node or its jobs (their views may be stale; "
            "`dacp projections rebuild` once the cause is fixed):"
        )
        for skip in skips:
            lines.append(
                f"  #{skip['notification_id']} {skip['event']} of {skip['originator_id']} "
                f"at {table_time(str(skip['skipped_at']))}: {skip['error']}"
            )
    lines.append("")
    recent = report["recent_events"]
    lines.append(f"recent events (last {len(recent)}):")
    lines.extend(f"  {line}" for line in timeline_table(recent))
    return lines


# ----------------------------------------------------------- projections

_ROW_KEYS: dict[str, tuple[str, ...]] = {
    "nodes": ("node_id",),
    "eligibility": ("node_id",),
    "jobs": ("job_id",),
    "models": ("name",),
    "job_nodes": ("job_id", "node_id"),
}


def diff_dumps(
    live: Mapping[str, list[dict[str, Any]]],
    rebuilt: Mapping[str, list[dict[str, Any]]],
    examples: int = DIFF_EXAMPLES,
) -> list[str]:
    """A short account of how two view dumps differ (``[]`` when they are equal)."""
    lines: list[str] = []
    for view in sorted({*live, *rebuilt}):
        keys = _ROW_KEYS.get(view, ())

        def key(row: Mapping[str, Any], keys: tuple[str, ...] = keys) -> str:
            return "/".join(str(row.get(k)) for k in keys) if keys else repr(sorted(row.items()))

        a = {key(r): r for r in live.get(view, [])}
        b = {key(r): r for r in rebuilt.get(view, [])}
        only_live = sorted(a.keys() - b.keys())
        only_rebuilt = sorted(b.keys() - a.keys())
        changed = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
        if not (only_live or only_rebuilt or changed):
            continue
        lines.append(
            f"{view}: {len(a)} live rows, {len(b)} rebuilt; {len(only_live)} only live, "
            f"{len(only_rebuilt)} only rebuilt, {len(changed)} differ"
        )
        for k in changed[:examples]:
            fields = sorted(f for f in a[k].keys() | b[k].keys() if a[k].get(f) != b[k].get(f))
            lines.append(f"  {k}: {', '.join(fields)}")
        lines.extend(f"  {k}: only live" for k in only_live[:examples])
        lines.extend(f"  {k}: only rebuilt" for k in only_rebuilt[:examples])
    return lines


def _tracked(store: ReadModelStore) -> int:
    return store.max_tracking_id(store.view_name) or 0


def _close(store: ReadModelStore) -> None:
    factory = getattr(store, "factory", None)
    if factory is not None:
        factory.close()


@_guarded
def cmd_projections_rebuild(args: argparse.Namespace) -> int:
    with opened(args) as storage:
        live = storage.read_model
        shadow = open_read_model(storage.env, view_name=SHADOW_VIEW)
        try:
            replayed = rebuild(storage.app, shadow)
            diff = diff_dumps(live.dump(), shadow.dump())
            live_at, shadow_at = _tracked(live), _tracked(shadow)
            shadow.clear()
        finally:
            _close(shadow)
        if not diff:
            print(
                f"projections match: {replayed} events rebuilt into {SHADOW_VIEW} "
                f"(store position {shadow_at}) equal the live views"
            )
        else:
            print(
                f"projections differ: live views at position {live_at}, "
                f"rebuilt to position {shadow_at}"
            )
            print("\n".join(diff))
        if args.replace:
            replayed = rebuild(storage.app, live)
            print(f"live views rebuilt in place: {replayed} events (position {_tracked(live)})")
            return 0
    return 1 if diff else 0


# ------------------------------------------------------------- registration


def _store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=None,
        help="event store URL (default: DATABASE_URL, else the SQLite file under var/)",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``events``, ``replay``, ``diagnose`` and ``projections`` to ``dacp``."""
    events = sub.add_parser("events", help="an aggregate's event timeline")
    events_sub = events.add_subparsers(dest="events_kind", required=True)
    for kind, what in (("node", "NODE_ID or node name"), ("job", "JOB_ID")):
        p = events_sub.add_parser(kind, help=f"every event of a {kind}, oldest first")
        p.add_argument("ident", metavar=what.split(" ")[0], help=what)
        p.add_argument("--json", action="store_true", help="print a JSON list instead")
        _store_option(p)
        p.set_defaults(func=cmd_events, kind=kind)

    rep = sub.add_parser("replay", help="an aggregate's state at a past version or time")
    rep.add_argument("kind", choices=("node", "job"))
    rep.add_argument("ident", metavar="ID", help="node id or name, or job id")
    point = rep.add_mutually_exclusive_group()
    point.add_argument("--at", default=None, help="ISO 8601 time (UTC unless it says otherwise)")
    point.add_argument("--version", type=int, default=None, help="aggregate version")
    _store_option(rep)
    rep.set_defaults(func=cmd_replay)

    diag = sub.add_parser("diagnose", help="what to capture when a node misbehaves")
    diag.add_argument("ident", metavar="NODE", help="node id or name")
    diag.add_argument("--json", action="store_true", help="print the report as JSON")
    diag.add_argument("--recent", type=int, default=20, help="recent events to show")
    _store_option(diag)
    diag.set_defaults(func=cmd_diagnose)

    proj = sub.add_parser("projections", help="read-model views")
    proj_sub = proj.add_subparsers(dest="projections_command", required=True)
    reb = proj_sub.add_parser(
        "rebuild", help="rebuild the views into a shadow copy and compare with the live ones"
    )
    reb.add_argument(
        "--replace", action="store_true", help="then also rebuild the live views in place"
    )
    _store_option(reb)
    reb.set_defaults(func=cmd_projections_rebuild)
