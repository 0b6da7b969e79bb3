"""``dacp`` commands that are given a node or job nothing answers to name the closest known
ones, in the one line they exit 2 with (real Postgres and SQLite stores)."""

from __future__ import annotations

import pytest

from infrastructure.storage import Storage
from interfaces.cli import main as cli
from tests.integration.incident import Incident, database_url, script_incident


@pytest.fixture
def incident(storage: Storage) -> Incident:
    return script_incident(storage)  # nodes node-a and node-b, and their jobs


def refusal(capsys: pytest.CaptureFixture[str], storage: Storage, *argv: str) -> str:
    """The one line ``dacp ARGV`` exits 2 with."""
    capsys.readouterr()
    code = cli.main([*argv, "--database-url", database_url(storage.env)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


@pytest.mark.parametrize("argv", [["diagnose", "node-c"], ["events", "node", "Node-C"]])
def test_a_mistyped_node_name_gets_the_closest_known(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    line = refusal(capsys, storage, *argv)
    prefix = f"dacp: unknown node {argv[-1]}; closest known: "
    assert line.startswith(prefix), line
    assert sorted(line.removeprefix(prefix).split(", ")) == ["node-a", "node-b"]


def test_with_nothing_close_the_few_known_nodes_are_listed(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refusal(capsys, storage, "replay", "node", "ghost")
    assert line == "dacp: unknown node ghost; known: node-a, node-b"


def test_a_mistyped_job_id_gets_the_closest_known(
    storage: Storage, incident: Incident, capsys: pytest.CaptureFixture[str]
) -> None:
    job = str(incident.completed_job)
    typo = job[:-1] + ("0" if job[-1] != "0" else "1")
    line = refusal(capsys, storage, "events", "job", typo)
    assert line.startswith(f"dacp: unknown job {typo}; closest known: {job}"), line
