"""Room for model files (application/model_transfers.py, agent/models/model_fetch.py models_room): a
node whose agent says the model does not fit (its disk, or --models-disk-limit) is not asked
to fetch it on demand, and an operator's pull onto it is refused saying why; a node whose
fetch failed is left alone for a while, so the next requests do not repeat the failure. In
memory, a fake gateway, a fake clock."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.models.model_fetch import DISK_RESERVE_BYTES, models_room
from application.commands import TransferReport
from application.model_transfers import (
    FAILED_COOLDOWN_SECONDS,
    TransferCoordinator,
    TransferRefused,
)
from common.contract import TRANSFER_PORT_LABEL
from domain.node import resources_differ
from interfaces.grpc.grpc_convert import inventory_to_dict
from tests.unit.job_cluster import MODEL, Cluster
from wire import control_pb2 as pb

SIZE = 100 << 20  # what job_cluster's nodes report for MODEL


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(rooms: dict[str, int | None]) -> tuple[Cluster, dict[str, str], Clock]:
    """Node "a" holds the model and serves it; the others lack it, with the room given."""
    cluster = Cluster(nodes=0)
    a = cluster.add_node("a")
    cluster.read.catch_up()
    cluster.read.nodes[a]["labels"] = {TRANSFER_PORT_LABEL: "50053"}
    ids = {"a": a}
    for name, room in rooms.items():
        node_id = cluster.add_node(name, holds_model=False)
        cluster.read.catch_up()
        resources = dict(cluster.read.nodes[node_id].get("resources") or {})
        resources["models_free_bytes"] = room
        cluster.read.nodes[node_id]["resources"] = resources
        ids[name] = node_id
    return cluster, ids, Clock()


def coordinator(cluster: Cluster, clock: Clock, primary: Any) -> TransferCoordinator:
    return TransferCoordinator(
        cluster.app,
        cluster.read,
        cluster.gateway,
        lambda sha, node: f"ticket:{node}",
        primary_if_held=primary,
        clock=clock,
    )


def any_primary(model: dict[str, Any], nodes: frozenset[str]) -> str | None:
    return next(iter(nodes))


async def test_an_on_demand_fetch_skips_a_node_the_model_does_not_fit() -> None:
    cluster, ids, clock = setup({"small": SIZE - 1, "roomy": SIZE})
    transfers = coordinator(cluster, clock, any_primary)
    assert transfers.fetch_for(MODEL)
    assert [node for node, _ in cluster.gateway.fetches] == [ids["roomy"]]


async def test_a_node_that_does_not_say_its_room_may_be_asked() -> None:
    cluster, ids, clock = setup({"old-agent": None})
    assert coordinator(cluster, clock, any_primary).fetch_for(MODEL)
    assert [node for node, _ in cluster.gateway.fetches] == [ids["old-agent"]]


async def test_no_on_demand_fetch_when_the_model_fits_nowhere() -> None:
    cluster, _, clock = setup({"small": 1 << 20})
    assert not coordinator(cluster, clock, any_primary).fetch_for(MODEL)
    assert cluster.gateway.fetches == []


async def test_a_pull_onto_a_node_without_room_is_refused_saying_why() -> None:
    cluster, ids, clock = setup({"small": 1 << 20, "roomy": SIZE})
    transfers = coordinator(cluster, clock, any_primary)
    with pytest.raises(TransferRefused) as refused:
        transfers.pull(MODEL, [ids["roomy"], ids["small"]])
    message = str(refused.value)
    assert f"{1 << 20} bytes" in message and str(SIZE) in message
    assert "dacp models evict MODEL --node small" in message
    assert cluster.gateway.fetches == []  # roomy was not asked either: all or none


async def failed_once() -> tuple[Cluster, TransferCoordinator, str, Clock]:
    """Node "b" was asked to fetch the model on demand, and its fetch failed."""
    cluster, ids, clock = setup({"b": SIZE})
    transfers = coordinator(cluster, clock, any_primary)
    assert transfers.fetch_for(MODEL)
    ((node, request),) = cluster.gateway.fetches
    failed = TransferReport(request.transfer_id, MODEL["sha256"], "failed", error="disk")
    await transfers.reported(node, failed)
    return cluster, transfers, ids["b"], clock


async def test_a_node_whose_fetch_failed_is_not_asked_again_for_a_while() -> None:
    cluster, transfers, b, clock = await failed_once()
    assert not transfers.fetch_for(MODEL)  # the same failure would hold the jobs back again
    clock.now += FAILED_COOLDOWN_SECONDS
    assert transfers.fetch_for(MODEL)
    assert [n for n, _ in cluster.gateway.fetches] == [b, b]


async def test_an_operators_pull_asks_a_node_whose_fetch_failed_at_once() -> None:
    _, transfers, b, _ = await failed_once()
    assert [p.node_id for p in transfers.pull(MODEL, [b])] == [b]


def test_the_agent_reports_the_room_its_disk_and_limit_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk_free = DISK_RESERVE_BYTES + 50_000  # a disk the test controls: 50,000 bytes of room
    monkeypatch.setattr(
        "agent.models.model_fetch.shutil.disk_usage", lambda path: SimpleNamespace(free=disk_free)
    )
    models = tmp_path / "models"
    models.mkdir()
    (models / "held.gguf").write_bytes(b"x" * 3000)
    (models / "coming.gguf.partial").write_bytes(b"x" * 1000)
    (models / "notes.txt").write_bytes(b"x" * 5000)  # not a model file: not counted
    assert models_room(models, 10_000) == 6000
    assert models_room(models, 3000) == 0
    free = models_room(models, None)
    assert free > 0 and models_room(models, 1 << 60) == free  # the disk is the limit
    assert free == disk_free - DISK_RESERVE_BYTES


def test_the_room_reaches_the_node_row_only_when_the_agent_says_it() -> None:
    said = inventory_to_dict(pb.Inventory(models_free_bytes=0))
    assert said["models_free_bytes"] == 0  # no room at all, not "unknown"
    assert inventory_to_dict(pb.Inventory())["models_free_bytes"] is None


def test_the_room_is_news_only_when_it_moves_by_more_than_a_tenth() -> None:
    """Disk space moves all the time: a report is not an event for every byte of it."""
    before = {"ram_free_bytes": 8 << 30, "models_free_bytes": 10_000}
    assert not resources_differ(before, {**before, "models_free_bytes": 10_900})
    assert resources_differ(before, {**before, "models_free_bytes": 8_000})
