"""Which node fetches a model from where (application/model_transfers.py), on an in-memory
store with a fake agent gateway: sources that hold the file and serve files, the least busy
first; tickets for the fetching node; events as the node reports; on-demand fetches only onto
a node that could then run the job."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from application.commands import TransferReport
from application.model_transfers import TransferCoordinator, TransferRefused
from common.contract import TRANSFER_PORT_LABEL
from domain.catalog import code_of
from domain.errors import InvalidCommand
from domain.model import validate_source
from tests.unit.job_cluster import MODEL, Cluster


def coordinator(
    cluster: Cluster, primary_if_held: Any = None, *, signer: bool = True
) -> TransferCoordinator:
    return TransferCoordinator(
        cluster.app,
        cluster.read,
        cluster.gateway,
        (lambda sha, node: f"ticket:{sha[:4]}:{node}") if signer else None,
        primary_if_held=primary_if_held,
        clock=lambda: 100.0,
    )


def serving(cluster: Cluster, *names: str) -> list[str]:
    """Nodes that hold the model and serve files (the transfer port label)."""
    ids = []
    for name in names:
        node_id = cluster.add_node(name)
        cluster.read.catch_up()
        cluster.read.nodes[node_id]["labels"] = {TRANSFER_PORT_LABEL: "50053"}
        ids.append(node_id)
    return ids


def lacking(cluster: Cluster, name: str) -> str:
    return cluster.add_node(name, holds_model=False)


async def test_a_pull_asks_the_node_with_tickets_for_it_least_busy_source_first() -> None:
    cluster = Cluster(nodes=0)
    a, b = serving(cluster, "a", "b")
    c, d = lacking(cluster, "c"), lacking(cluster, "d")
    transfers = coordinator(cluster)
    first = transfers.pull(MODEL, [c])
    second = transfers.pull(MODEL, [d, a])  # a holds it already: left alone
    assert [p.node_id for p in first + second] == [c, d]
    (node, request), (node2, request2) = cluster.gateway.fetches
    assert (node, node2) == (c, d)
    # c's fetch keeps the first source busy: d starts with the other.
    assert request.sources[0].node_id != request2.sources[0].node_id
    assert {s.node_id for s in request.sources} == {a, b}
    assert all(s.ticket.endswith(c) for s in request.sources)
    assert request.size_bytes == 100 << 20 and request.file_name == MODEL["file_name"]
    assert transfers.pull(MODEL, [c]) == []  # being fetched already


async def test_reports_become_events_on_the_fetching_node() -> None:
    cluster = Cluster(nodes=0)
    (a,) = serving(cluster, "a")
    c = lacking(cluster, "c")
    added: list[bool] = []
    transfers = coordinator(cluster)
    transfers.on_model_added = lambda: added.append(True)
    (pull,) = transfers.pull(MODEL, [c])
    for state, done in (("started", 0), ("progress", 50), ("completed", 100)):
        report = TransferReport(pull.transfer_id, MODEL["sha256"], state, done, 100, a)
        await transfers.reported(c, report)
    codes = [code_of(e) for e in cluster._events(c)]
    assert codes[-3:] == [
        "MODEL_TRANSFER_STARTED",
        "MODEL_TRANSFER_PROGRESS",
        "MODEL_TRANSFER_COMPLETED",
    ]
    assert added == [True] and transfers.running == {}
    # A report about a transfer nobody asked for is not recorded.
    await transfers.reported(c, TransferReport("other", MODEL["sha256"], "started"))
    assert len(cluster._events(c)) == len(codes)


async def test_a_pull_that_cannot_happen_is_refused() -> None:
    cluster = Cluster(nodes=0)
    c = lacking(cluster, "c")
    with pytest.raises(TransferRefused, match="no node in service holds"):
        coordinator(cluster).pull(MODEL, [c])
    serving(cluster, "a")
    with pytest.raises(TransferRefused, match="cannot sign"):
        coordinator(cluster, signer=False).pull(MODEL, [c])
    cluster.gateway.disconnected.add(c)
    with pytest.raises(TransferRefused, match="not connected"):
        coordinator(cluster).pull(MODEL, [c])


async def test_an_on_demand_fetch_goes_only_where_the_job_could_then_run() -> None:
    cluster = Cluster(nodes=0)
    serving(cluster, "a")
    c, d = lacking(cluster, "c"), lacking(cluster, "d")
    asked: list[frozenset[str]] = []

    def primary_if_held(model: dict[str, Any], nodes: frozenset[str]) -> str | None:
        asked.append(nodes)
        return d if d in nodes else None  # c is too small to be a primary

    transfers = coordinator(cluster, primary_if_held)
    assert transfers.fetch_for(MODEL)
    assert [node for node, _ in cluster.gateway.fetches] == [d]
    assert frozenset({c}) in asked
    assert transfers.fetch_for(MODEL)  # under way: the jobs wait
    assert len(cluster.gateway.fetches) == 1
    (transfer_id,) = transfers.running
    await transfers.reported(d, TransferReport(transfer_id, MODEL["sha256"], "failed", error="x"))
    assert not transfers.running


async def test_no_on_demand_fetch_when_nobody_could_run_the_job() -> None:
    cluster = Cluster(nodes=0)
    serving(cluster, "a")
    lacking(cluster, "c")
    assert not coordinator(cluster, lambda model, nodes: None).fetch_for(MODEL)
    assert cluster.gateway.fetches == []
    assert not coordinator(cluster, None).fetch_for(MODEL)


async def test_an_eviction_waits_for_the_nodes_word_and_is_recorded() -> None:
    cluster = Cluster(nodes=0)
    (a,) = serving(cluster, "a")
    transfers = coordinator(cluster)
    evicting = asyncio.create_task(transfers.evict(a, MODEL))
    while not cluster.gateway.evictions:
        await asyncio.sleep(0)
    assert cluster.gateway.evictions == [(a, MODEL["sha256"])]
    await transfers.evicted(a, MODEL["sha256"], True, "m.gguf", "")
    assert await evicting == "m.gguf"
    assert code_of(cluster._events(a)[-1]) == "MODEL_EVICTED"


async def test_an_eviction_is_refused_while_jobs_use_the_model_or_the_node_says_no() -> None:
    cluster = Cluster(nodes=0)
    (a,) = serving(cluster, "a")
    transfers = coordinator(cluster)
    with pytest.raises(TransferRefused, match="does not hold"):
        await transfers.evict(lacking(cluster, "c"), MODEL)
    cluster.read.nodes[a]["current_jobs"] = ["job-1"]
    cluster.read.nodes[a]["runtime"] = {"key": "k", "plan": {"model_sha256": MODEL["sha256"]}}
    with pytest.raises(TransferRefused, match="use model"):
        await transfers.evict(a, MODEL)
    assert cluster.gateway.evictions == []
    cluster.read.nodes[a]["current_jobs"] = []
    evicting = asyncio.create_task(transfers.evict(a, MODEL))
    while not cluster.gateway.evictions:
        await asyncio.sleep(0)
    await transfers.evicted(a, MODEL["sha256"], False, "m.gguf", "a job uses the model now")
    with pytest.raises(TransferRefused, match="a job uses the model now"):
        await evicting
    assert "MODEL_EVICTED" not in [code_of(e) for e in cluster._events(a)]


async def test_a_model_with_an_http_source_is_fetched_from_it_when_no_node_holds_it() -> None:
    cluster = Cluster(nodes=0)
    c = lacking(cluster, "c")
    url = "http://10.0.0.9:8080/models/m.gguf"
    cluster.app.add_model_source(MODEL["name"], url)
    cluster.app.add_model_source(MODEL["name"], url)  # known already: nothing more
    row = cluster.read.get_model(MODEL["name"])
    assert row is not None and row["sources"] == [url]
    codes = [c for c, _ in cluster.all_codes()]
    assert codes.count("MODEL_SOURCE_ADDED") == 1
    (pull,) = coordinator(cluster).pull(row, [c])
    ((_, request),) = cluster.gateway.fetches
    assert pull.sources == (url,) and request.sources[0].url == url
    assert request.size_bytes == 0  # the URL's answer says
    cluster.app.remove_model_source(MODEL["name"], url)
    row = cluster.read.get_model(MODEL["name"])
    assert row is not None and row["sources"] == []


def test_a_source_is_an_http_url() -> None:
    for good in ("http://host/m.gguf", "https://10.0.0.5:8443/a/b.gguf", "http://[::1]:80/x"):
        validate_source(good)
    for bad in ("ftp://host/m.gguf", "file:///etc/passwd", "http://", "https://ho st/x"):
        with pytest.raises(InvalidCommand):
            validate_source(bad)


async def test_a_fetch_whose_node_went_away_no_longer_holds_jobs_back() -> None:
    cluster = Cluster(nodes=0)
    serving(cluster, "a")
    c, d = lacking(cluster, "c"), lacking(cluster, "d")
    transfers = coordinator(cluster, lambda model, nodes: next(iter(nodes)))
    assert transfers.fetch_for(MODEL)
    (first, _), *_ = cluster.gateway.fetches
    cluster.gateway.disconnected.add(first)  # its agent died mid-fetch
    assert transfers.fetch_for(MODEL)  # another node fetches instead
    assert [node for node, _ in cluster.gateway.fetches] == [first, ({c, d} - {first}).pop()]


async def test_a_replica_fetch_goes_only_where_the_model_would_run_alone() -> None:
    """fetch_replica asks replica_if_held (a plan of that one node), never primary_if_held
    (which a split would satisfy)."""
    cluster = Cluster(nodes=0)
    serving(cluster, "a")
    c, d = lacking(cluster, "c"), lacking(cluster, "d")
    transfers = TransferCoordinator(
        cluster.app,
        cluster.read,
        cluster.gateway,
        lambda sha, node: f"ticket:{node}",
        primary_if_held=lambda model, nodes: next(iter(nodes)),  # anyone, in a split
        replica_if_held=lambda model, nodes: d if d in nodes else None,  # d alone holds it
        clock=lambda: 100.0,
    )
    assert transfers.fetch_replica(MODEL)
    assert [node for node, _ in cluster.gateway.fetches] == [d]
    assert transfers.fetch_replica(MODEL)  # under way: no second fetch
    assert len(cluster.gateway.fetches) == 1
    assert c not in {node for node, _ in cluster.gateway.fetches}
    nobody = coordinator(Cluster(nodes=0), lambda model, nodes: next(iter(nodes)))
    assert not nobody.fetch_replica(MODEL)  # no replica_if_held: no replica fetch
