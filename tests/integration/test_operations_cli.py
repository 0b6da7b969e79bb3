"""``dacp events | replay | diagnose | projections`` over real Postgres and SQLite."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from eventsourcing.persistence import Tracking

from application.diagnosis import (
    CONTROLLER_UNREACHABLE,
    NODE_LOST,
    PUBLIC_PEER,
    RPC_WORKER_LOST,
)
from application.timeline import job_timeline, parse_time, timeline
from application.version import CONTROLLER_VERSION
from infrastructure.storage import Storage
from interfaces.cli import main as cli
from tests.dacp_cli import run_dacp
from tests.integration.incident import Incident, database_url, script_incident


@pytest.fixture
def incident(storage: Storage) -> Incident:
    return script_incident(storage)


def dacp(capsys: pytest.CaptureFixture[str], storage: Storage, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    url = database_url(storage.env)
    code = cli.main([*argv, "--database-url", url])
    out, err = capsys.readouterr()
    if code == 0:  # a command that succeeds ends by naming the store it read
        *err_lines, used = err.splitlines(keepends=True)
        assert used.startswith("dacp: used the event store ") and "(--database-url)" in used, err
        err = "".join(err_lines)
    return code, out, err


def test_node_timeline_table(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dacp(capsys, storage, "events", "node", str(incident.node_a))
    assert (code, err) == (0, "")
    lines = out.rstrip("\n").split("\n")
    header = lines[0]
    assert header.split() == ["POS", "TIME", "(UTC)", "VER", "EVENT", "STATE", "SUMMARY"]
    event_col, summary_col = header.index("EVENT"), header.index("SUMMARY")
    codes = [line[event_col:].split()[0] for line in lines[1:]]
    assert codes == [
        "NODE_ENROLLED",
        "NODE_READY",
        "NODE_JOB_ASSIGNED",
        "HEARTBEAT_TIMEOUT",
        "NODE_OFFLINE",
    ]
    rows = dict(zip(codes, lines[1:], strict=True))
    assert rows["HEARTBEAT_TIMEOUT"][summary_col:] == "no heartbeat for 7.0 s"
    assert rows["NODE_OFFLINE"][summary_col:].startswith("no heartbeat for 16.0 s; lost jobs")
    assert "DEGRADED" in rows["HEARTBEAT_TIMEOUT"]
    positions = [int(line.split()[0]) for line in lines[1:]]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert lines[1].split()[1].endswith("Z")

    by_name = dacp(capsys, storage, "events", "node", "node-a")
    assert by_name == (0, out, "")


def test_job_timeline_json(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    job = str(incident.execution_failed_job)
    code, out, err = dacp(capsys, storage, "events", "job", job, "--json")
    assert (code, err) == (0, "")
    story = json.loads(out)
    # Node events about the job (its slots taken, RPC workers) are part of its story.
    assert "NODE_JOB_ASSIGNED" in [e["code"] for e in story]
    assert [e["position"] for e in story] == sorted(e["position"] for e in story)
    entries = [e for e in story if e["aggregate_id"] == job]
    assert [e["code"] for e in entries] == [
        "JOB_SUBMITTED",
        "JOB_PLANNED",
        "JOB_DISPATCHED",
        "JOB_SETUP_VALIDATED",
        "TOKEN_STREAM_CHUNK",
        "JOB_FAILED",
    ]
    assert [e["version"] for e in entries] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(e["position"], int) for e in entries)
    assert [e["position"] for e in entries] == sorted(e["position"] for e in entries)
    assert all(parse_time(e["time"]).utcoffset() is not None for e in entries)
    assert all(e["time"].endswith("+00:00") for e in entries)
    chunk, failed = entries[4], entries[5]
    assert chunk["summary"] == "2 deltas, 3 tokens, seq 0-1"
    assert chunk["payload"]["token_count"] == 3
    assert failed["payload"]["phase"] == "execution"
    assert failed["payload"]["error_code"] == "node_lost"
    assert failed["summary"].startswith("phase=execution reason=node node-b lost")
    assert failed["state"] == "FAILED"
    # The CLI prints exactly what the shared timeline code returns.
    assert story == json.loads(json.dumps(job_timeline(storage.app, incident.execution_failed_job)))


def test_replay_at_version_and_time(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = dacp(capsys, storage, "replay", "node", "node-b", "--version", "5")
    assert code == 0
    state = json.loads(out)
    # v1 enrolled, v2 ready, v3 assigned, v4 released, v5 security violation
    assert state["state"] == "READY"
    assert state["version"] == 5 and state["as_of"]["version"] == 5
    assert state["security_violations"] == 1
    assert state["jobs"] == [] and state["drain_requested"] is False
    assert state["credential_sha256"] == "<redacted>"

    code, out, _ = dacp(capsys, storage, "replay", "node", str(incident.node_b), "--version", "6")
    assert json.loads(out)["jobs"] == [str(incident.execution_failed_job)]
    assert json.loads(out)["state"] == "BUSY"

    code, out, _ = dacp(capsys, storage, "replay", "node", str(incident.node_b))
    now = json.loads(out)
    assert now["state"] == "OFFLINE" and now["jobs"] == []
    assert now["as_of"]["version"] == now["as_of"]["latest_version"] == 7

    job_events = timeline(storage.app, incident.execution_failed_job)
    validated_at = job_events[3]["time"]
    code, out, _ = dacp(
        capsys,
        storage,
        "replay",
        "job",
        str(incident.execution_failed_job),
        "--at",
        validated_at,
    )
    assert code == 0
    job = json.loads(out)
    assert job["state"] == "SETUP_VALIDATED" and job["version"] == 4
    assert job["tokens_streamed"] == 0 and job["failure_phase"] is None
    assert job["as_of"]["time"] == validated_at
    assert job["as_of"]["position"] == job_events[3]["position"]


def test_diagnose_names_the_events_the_read_model_skipped(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    node = str(incident.node_b)
    skip = {
        "notification_id": 10_000,
        "originator_id": node,
        "originator_version": 3,
        "event": "Node.ResourcesReported",
        "error": "KeyError: 'gpus'",
        "skipped_at": "2026-12-03T12:00:00+00:00",
    }
    tracking = Tracking(storage.read_model.view_name, 10_000)
    storage.read_model.record_skip(tracking, skip)
    code, out, err = dacp(capsys, storage, "diagnose", node)
    assert (code, err) == (0, "")
    assert "read model: skipped events" in out
    assert "#10000 Node.ResourcesReported" in out and "KeyError: 'gpus'" in out
    code, out, _ = dacp(capsys, storage, "diagnose", node, "--json")
    assert json.loads(out)["read_model_skips"] == [skip]
    code, out, _ = dacp(capsys, storage, "diagnose", "node-a")
    assert "read model" not in out  # another node's skip is not this one's


def test_diagnose_reports_phase_and_hint(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dacp(capsys, storage, "diagnose", "node-a", "--json")
    assert (code, err) == (0, "")
    a = json.loads(out)
    assert a["node_id"] == str(incident.node_a)
    assert a["agent_version"] == "0.1.0"
    assert a["controller_version"] == CONTROLLER_VERSION
    assert a["state"] == "OFFLINE" and a["last_state_change"]
    assert [e["code"] for e in a["recent_events"]][-2:] == ["HEARTBEAT_TIMEOUT", "NODE_OFFLINE"]
    [failed] = a["failed_jobs"]
    assert failed["job_id"] == str(incident.setup_failed_job)
    assert failed["phase"] == "setup" and failed["when"] == "before execution (setup)"
    assert failed["check"] == CONTROLLER_UNREACHABLE.check
    assert {f["code"] for f in a["findings"]} == {"HEARTBEAT_TIMEOUT", "NODE_OFFLINE"}
    assert {f["check"] for f in a["findings"]} == {CONTROLLER_UNREACHABLE.check}

    code, out, err = dacp(capsys, storage, "diagnose", str(incident.node_b))
    assert (code, err) == (0, "")
    assert "controller version  " + CONTROLLER_VERSION in out
    assert "agent version       0.1.0" in out
    assert "state               OFFLINE" in out
    assert f"{incident.execution_failed_job}  smollm2  failed during execution" in out
    # A one-node job: the node's own row, never an RPC worker it did not have.
    assert "check:  " + NODE_LOST.check in out and RPC_WORKER_LOST.check not in out
    assert "last stop           lost (no goodbye: a crash, a kill or the network) at " in out
    assert out.split("last stop")[1].split("\n")[0].endswith(": control stream closed")
    assert PUBLIC_PEER.check in out  # the SECURITY_VIOLATION finding
    assert "fails during execution: 0 before, 1 during execution" in out
    assert str(incident.completed_job) not in out.split("recent events")[0]
    assert "recent events (last 7):" in out

    code, out, _ = dacp(capsys, storage, "diagnose", "node-b", "--json", "--recent", "3")
    b = json.loads(out)
    assert len(b["recent_events"]) == 3
    assert [j["phase"] for j in b["failed_jobs"]] == ["execution"]
    assert b["jobs_considered"] == 2


def test_a_job_is_named_by_any_id_a_person_has_seen(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    """The full id, the short id the tables show (or any longer beginning, with or without
    dashes), and the ``chatcmpl-``/``cmpl-`` id the SDK returned all name the same job."""
    job = str(incident.execution_failed_job)
    code, full, _ = dacp(capsys, storage, "events", "job", job, "--json")
    assert code == 0
    hex_id = job.replace("-", "")
    for form in (job[:8], job[:13], hex_id[:12], f"chatcmpl-{hex_id}", f"cmpl-{hex_id}"):
        assert dacp(capsys, storage, "events", "job", form, "--json") == (0, full, ""), form
        code, out, _ = dacp(capsys, storage, "replay", "job", form)
        assert code == 0 and job in out, form
    unknown = dacp(capsys, storage, "events", "job", "chatcmpl-" + "0" * 32)
    assert unknown[0] == 2 and unknown[2].startswith("dacp: unknown job")


@pytest.mark.parametrize(
    "argv",
    [
        ["events", "node", "no-such-node"],
        ["events", "node", str(uuid.uuid4())],
        ["events", "job", str(uuid.uuid4())],
        ["events", "job", "not-a-uuid"],
        ["replay", "job", str(uuid.uuid4())],
        ["diagnose", "no-such-node"],
        ["diagnose", str(uuid.uuid4()), "--json"],
    ],
)
def test_unknown_ids_exit_2_with_one_line(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = dacp(capsys, storage, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("dacp: unknown ") and err.count("\n") == 1


def test_wrong_kind_and_bad_points_exit_2(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["events", "job", str(incident.node_a)], "is a node, not a job"),
        (["events", "node", str(incident.completed_job)], "is a job, not a node"),
        (["replay", "node", "node-a", "--version", "99"], "has only 5 versions"),
        (["replay", "node", "node-a", "--version", "0"], "versions start at 1"),
        (["replay", "node", "node-a", "--at", "2001-01-01T00:00:00Z"], "did not exist yet"),
        (["replay", "node", "node-a", "--at", "yesterday"], "ISO 8601"),
    ]
    for argv, message in cases:
        code, out, err = dacp(capsys, storage, *argv)
        assert (code, out) == (2, ""), argv
        assert message in err and err.count("\n") == 1, argv


def test_projections_rebuild_match_and_mismatch(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dacp(capsys, storage, "projections", "rebuild")
    assert (code, err) == (0, "")
    assert out.startswith("projections match:")

    live = storage.read_model
    with live._transaction(commit=True) as c:
        c.execute(
            live._sql(f"DELETE FROM {live._t('jobs')} WHERE job_id = ?"),
            (str(incident.completed_job),),
        )
    code, out, _ = dacp(capsys, storage, "projections", "rebuild")
    assert code == 1
    assert out.startswith("projections differ:")
    assert "jobs: 2 live rows, 3 rebuilt; 0 only live, 1 only rebuilt, 0 differ" in out
    assert f"{incident.completed_job}: only rebuilt" in out

    code, out, _ = dacp(capsys, storage, "projections", "rebuild", "--replace")
    assert code == 0 and "live views rebuilt in place" in out
    assert live.get_job(str(incident.completed_job)) is not None
    code, out, _ = dacp(capsys, storage, "projections", "rebuild")
    assert code == 0 and out.startswith("projections match:")


def test_python_dash_m_entry_point(storage: Storage, incident: Incident) -> None:
    env = {**os.environ, "DATABASE_URL": database_url(storage.env)}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return run_dacp(*argv, env=env, timeout=120)

    done = run("events", "node", "node-b")
    assert done.returncode == 0, done.stderr
    assert "SECURITY_VIOLATION" in done.stdout and "control stream closed" in done.stdout
    missing = run("events", "node", "ghost")
    assert missing.returncode == 2
    assert missing.stdout == ""
    assert missing.stderr == "dacp: unknown node ghost; known: node-a, node-b\n"


def test_no_store_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("DACP_VAR_DIR", str(tmp_path / "var"))
    assert cli.main(["events", "node", "x"]) == 2
    assert not (tmp_path / "var").exists()
