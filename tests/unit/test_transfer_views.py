"""Model transfers as operators read them: the node row's ``transfers`` (what the dashboard
draws), the one-line event summaries, and ``dacp diagnose``'s transfers section and finding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from application.commands import FetchRequest, TransferReport, TransferSource
from application.diagnosis import MODEL_TRANSFER, diagnose, transfer_history, transfer_line
from application.read_models import TRANSFER_FAILURES_KEPT, project_node
from application.timeline import size_text, source_text, state_of, summarize, timeline
from interfaces.cli.events_cli import diagnosis_text
from interfaces.http.admin.admin_api import node_view
from tests.unit.job_cluster import Cluster

SHA = "a" * 64
MIB = 1 << 20
URL = "https://files.lan/models/m.gguf?key=secret"
URL_SOURCE = TransferSource("", "", 0, "", URL)


def fetch(transfer_id: str, size: int, *sources: TransferSource) -> FetchRequest:
    return FetchRequest(transfer_id, SHA, "m.gguf", size, sources)


def fetch_of(transfer_id: str, sha256: str, file_name: str) -> FetchRequest:
    return FetchRequest(transfer_id, sha256, file_name, 10 * MIB, (node_source("holder"),))


def node_source(node_id: str) -> TransferSource:
    return TransferSource(node_id, "127.0.0.1", 50053, "ticket")


def row_of(cluster: Cluster, node_id: str) -> dict[str, Any]:
    row: dict[str, Any] | None = None
    for event in cluster._events(node_id):
        row = project_node(row, event)
    assert row is not None
    return row


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (100 * MIB, "100.0 MiB"),
        (3 << 30, "3.0 GiB"),
    ],
)
def test_sizes_read_as_people_read_them(value: int, text: str) -> None:
    assert size_text(value) == text


def test_sources_are_short_node_ids_urls_without_their_query_or_names() -> None:
    node_id = "0123abcd-0000-4000-8000-000000000000"
    assert source_text(node_id) == "0123abcd"
    assert source_text(URL) == "https://files.lan/models/m.gguf"
    assert source_text("controller") == "controller"


@pytest.mark.parametrize(
    ("code", "payload", "line"),
    [
        (
            "MODEL_TRANSFER_STARTED",
            {
                "transfer_id": "77777777-1",
                "file_name": "m.gguf",
                "size_bytes": 100 * MIB,
                "sources": ["0123abcd-0000-4000-8000-000000000000", URL],
            },
            "fetching m.gguf (100.0 MiB) from 0123abcd, then https://files.lan/models/m.gguf "
            "[transfer 77777777]",
        ),
        (
            "MODEL_TRANSFER_STARTED",
            {"transfer_id": "t", "file_name": "m.gguf", "size_bytes": 0, "sources": []},
            "fetching m.gguf (size unknown) from nowhere [transfer t]",
        ),
        (
            "MODEL_TRANSFER_PROGRESS",
            {"transfer_id": "t", "bytes_done": 25 * MIB, "size_bytes": 100 * MIB},
            "fetched 25% (25.0 MiB of 100.0 MiB) [transfer t]",
        ),
        (
            "MODEL_TRANSFER_PROGRESS",
            {"transfer_id": "t", "bytes_done": 3 * MIB, "size_bytes": 0},
            "fetched 3.0 MiB (size unknown) [transfer t]",
        ),
        (
            "MODEL_TRANSFER_COMPLETED",
            {"transfer_id": "t", "sha256": SHA, "source_node_id": URL},
            "model aaaaaaaaaaaa fetched from https://files.lan/models/m.gguf [transfer t]",
        ),
        (
            "MODEL_TRANSFER_COMPLETED",
            {"transfer_id": "t", "sha256": SHA, "source_node_id": ""},
            "model aaaaaaaaaaaa fetched [transfer t]",
        ),
        (
            "MODEL_TRANSFER_FAILED",
            {"transfer_id": "t", "sha256": SHA, "error": "sha256 mismatch"},
            "fetching model aaaaaaaaaaaa failed: sha256 mismatch [transfer t]",
        ),
    ],
)
def test_transfer_summaries(code: str, payload: dict[str, Any], line: str) -> None:
    assert summarize(code, payload) == line


async def test_the_row_holds_a_transfer_under_way_and_learns_a_urls_size() -> None:
    cluster = Cluster(nodes=0)
    node = cluster.add_node("fetcher", holds_model=False)
    cluster.app.transfer_started(node, fetch("t1", 0, TransferSource("", "", 0, "", URL)))
    [transfer] = row_of(cluster, node)["transfers"].values()
    assert (transfer["bytes_done"], transfer["size_bytes"], transfer["sources"]) == (0, 0, [URL])
    # The URL's answer told the agent the size: progress reports carry it.
    report = TransferReport("t1", SHA, "progress", bytes_done=50 * MIB, size_bytes=200 * MIB)
    cluster.app.transfer_reported(node, report)
    assert row_of(cluster, node)["transfers"]["t1"] == {
        **transfer,
        "bytes_done": 50 * MIB,
        "size_bytes": 200 * MIB,
    }
    # A report without a size keeps the one known.
    cluster.app.transfer_reported(node, TransferReport("t1", SHA, "progress", 60 * MIB, 0))
    assert row_of(cluster, node)["transfers"]["t1"]["size_bytes"] == 200 * MIB
    cluster.app.transfer_reported(node, TransferReport("t1", SHA, "failed", error="disk full"))
    assert row_of(cluster, node)["transfers"] == {}


def fail(cluster: Cluster, node: str, request: FetchRequest, error: str) -> None:
    cluster.app.transfer_started(node, request)
    cluster.app.transfer_reported(
        node, TransferReport(request.transfer_id, request.sha256, "failed", error=error)
    )


def failure_ids(cluster: Cluster, node: str) -> list[str]:
    return [f["transfer_id"] for f in row_of(cluster, node)["transfer_failures"]]


async def test_the_row_keeps_a_failed_transfer_as_far_as_it_got() -> None:
    cluster = Cluster(nodes=0)
    source = cluster.add_node("holder")
    node = cluster.add_node("fetcher", holds_model=False)
    assert "transfer_failures" not in row_of(cluster, node)  # none yet: readers use .get
    cluster.app.transfer_started(node, fetch("t1", 100 * MIB, node_source(source), URL_SOURCE))
    cluster.app.transfer_reported(node, TransferReport("t1", SHA, "progress", 25 * MIB, 100 * MIB))
    cluster.app.transfer_reported(node, TransferReport("t1", SHA, "failed", error="disk full"))
    row = row_of(cluster, node)
    started, failed = (cluster._events(node)[i] for i in (-3, -1))
    assert row["transfers"] == {}
    assert row["transfer_failures"] == [
        {
            "transfer_id": "t1",
            "sha256": SHA,
            "file_name": "m.gguf",
            "error": "disk full",
            "failed_at": failed.timestamp.isoformat(),
            "started_at": started.timestamp.isoformat(),
            "bytes_done": 25 * MIB,
            "size_bytes": 100 * MIB,
            "sources": [source, URL],
        }
    ]


async def test_the_row_keeps_the_newest_failures_only() -> None:
    cluster = Cluster(nodes=0)
    node = cluster.add_node("fetcher", holds_model=False)
    for i in range(TRANSFER_FAILURES_KEPT + 2):
        fail(cluster, node, fetch_of(f"t{i}", f"{i:x}" * 64, f"m{i}.gguf"), f"error {i}")
    assert TRANSFER_FAILURES_KEPT == 3
    assert failure_ids(cluster, node) == ["t4", "t3", "t2"]  # newest first, the oldest dropped
    assert [f["error"] for f in row_of(cluster, node)["transfer_failures"]] == [
        "error 4",
        "error 3",
        "error 2",
    ]


async def test_fetching_the_model_after_all_clears_its_failures_only() -> None:
    cluster = Cluster(nodes=0)
    node = cluster.add_node("fetcher", holds_model=False)
    other = "b" * 64
    fail(cluster, node, fetch_of("t1", SHA, "m.gguf"), "connection refused")
    fail(cluster, node, fetch_of("t2", other, "o.gguf"), "sha256 mismatch")
    fail(cluster, node, fetch_of("t3", SHA, "m.gguf"), "timed out")
    assert failure_ids(cluster, node) == ["t3", "t2", "t1"]
    # A retry under way, and its progress, leave the failures be.
    cluster.app.transfer_started(node, fetch_of("t4", SHA, "m.gguf"))
    cluster.app.transfer_reported(node, TransferReport("t4", SHA, "progress", MIB, 10 * MIB))
    assert failure_ids(cluster, node) == ["t3", "t2", "t1"]
    # Completed: the node has the file; the other model's failure stays.
    cluster.app.transfer_reported(node, TransferReport("t4", SHA, "completed", source_node_id=""))
    row = row_of(cluster, node)
    assert row["transfers"] == {}
    assert failure_ids(cluster, node) == ["t2"]
    assert row["transfer_failures"][0]["error"] == "sha256 mismatch"
    # Another model's completion changes nothing.
    cluster.app.transfer_started(node, fetch_of("t5", "c" * 64, "c.gguf"))
    cluster.app.transfer_reported(
        node, TransferReport("t5", "c" * 64, "completed", source_node_id="")
    )
    assert failure_ids(cluster, node) == ["t2"]


async def test_rows_stored_before_the_failures_were_kept_take_them() -> None:
    """A row written before ``transfers`` or ``transfer_failures`` existed: its transfer's
    start is unknown, so the failure has no file name and no progress."""
    cluster = Cluster(nodes=0)
    node = cluster.add_node("fetcher", holds_model=False)
    fail(cluster, node, fetch_of("t1", SHA, "m.gguf"), "disk full")
    events = cluster._events(node)
    row: dict[str, Any] | None = None
    for event in events[:-2]:
        row = project_node(row, event)
    assert row is not None
    old = {k: v for k, v in row.items() if k not in ("transfers", "transfer_failures")}
    failed = project_node(old, events[-1])
    assert failed is not None
    assert failed["transfer_failures"] == [
        {
            "transfer_id": "t1",
            "sha256": SHA,
            "file_name": None,
            "error": "disk full",
            "failed_at": events[-1].timestamp.isoformat(),
            "started_at": None,
            "bytes_done": 0,
            "size_bytes": 0,
            "sources": [],
        }
    ]
    # A completion on a row without the key leaves it without.
    cluster.app.transfer_started(node, fetch_of("t2", SHA, "m.gguf"))
    cluster.app.transfer_reported(node, TransferReport("t2", SHA, "completed", source_node_id=""))
    done = project_node(old, cluster._events(node)[-1])
    assert done is not None and "transfer_failures" not in done


def test_the_api_gives_rows_without_failures_an_empty_list() -> None:
    """Rows stored before ``transfer_failures`` existed lack it; the API's node view (what the
    dashboard reads, documented as always having it) gives them none."""
    services: Any = SimpleNamespace(
        live=SimpleNamespace(get=lambda _id: None),
        connections=SimpleNamespace(is_connected=lambda _id: False),
    )
    old = {"node_id": "n", "name": "n", "state": "READY", "inventory": {}}
    assert node_view(services, old, 0.0)["transfer_failures"] == []
    failure = {"transfer_id": "t1", "sha256": SHA, "error": "disk full"}
    kept = node_view(services, {**old, "transfer_failures": [failure]}, 0.0)
    assert kept["transfer_failures"] == [failure]


async def test_diagnose_tells_each_transfer_and_finds_the_failed_ones() -> None:
    cluster = Cluster(nodes=0)
    source = cluster.add_node("holder")
    node = cluster.add_node("fetcher", holds_model=False)
    app = cluster.app
    app.transfer_started(node, fetch("t1", 100 * MIB, node_source(source)))
    app.transfer_reported(node, TransferReport("t1", SHA, "progress", 25 * MIB, 100 * MIB))
    app.transfer_reported(node, TransferReport("t1", SHA, "failed", error="connection refused"))
    app.transfer_started(node, fetch("t2", 100 * MIB, node_source(source)))
    app.transfer_reported(node, TransferReport("t2", SHA, "completed", source_node_id=source))
    app.transfer_started(node, fetch("t3", 0, TransferSource("", "", 0, "", URL)))
    app.transfer_reported(node, TransferReport("t3", SHA, "progress", 5 * MIB, 20 * MIB))

    events = timeline(app, node)
    history = transfer_history(events)
    assert [(t["transfer_id"], t["outcome"]) for t in history] == [
        ("t3", "under way"),
        ("t2", "completed"),
        ("t1", "failed"),
    ]
    src = source[:8]
    assert [transfer_line(t) for t in history] == [
        "m.gguf: under way, 25% (5.0 MiB of 20.0 MiB) from https://files.lan/models/m.gguf "
        "[transfer t3]",
        f"m.gguf: completed, 100.0 MiB from {src} [transfer t2]",
        f"m.gguf: failed at 25% (25.0 MiB of 100.0 MiB) from {src}: connection refused "
        "[transfer t1]",
    ]

    state = state_of(app.get_node(node))
    report = diagnose({**state, "node_id": node}, events, [], "9.9.9")
    assert [t["line"] for t in report["transfers"]] == [transfer_line(t) for t in history]
    [finding] = report["findings"]
    assert (finding["code"], finding["hint"]) == ("MODEL_TRANSFER_FAILED", MODEL_TRANSFER.key)
    assert finding["check"] == MODEL_TRANSFER.check
    assert "connection refused" in finding["summary"]

    text = "\n".join(diagnosis_text(report))
    assert "model transfers (newest first):" in text
    for line in (transfer_line(t) for t in history):
        assert line in text
    assert "secret" not in text
