"""The controller's own model store as a transfer source (application/model_transfers.py), on
an in-memory store with the fake agent gateway of tests/unit/test_model_transfers.py: the
store's source (``controller``, the agent fills in the host) with a ticket, its place among the
peers by the files each is sending now, on-demand fetches from it alone, all-or-nothing pulls,
URL-only pulls on a controller that cannot sign tickets; and which MODEL_STORE_PORT the store
is served on (interfaces/model_store_server.py, with a server that binds nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from application.commands import TransferSource
from application.model_transfers import TransferCoordinator, TransferRefused
from common.transfer_ticket import CONTROLLER_SOURCE_ID
from infrastructure import tls as tls_module
from infrastructure.settings import Settings
from infrastructure.tls import ServerTls
from interfaces import model_store_server
from tests.unit.job_cluster import MODEL, Cluster
from tests.unit.test_model_transfers import lacking, serving

STORE_PORT = 50054
URL = "http://10.0.0.9:8080/models/m.gguf"
#: The file as the nodes of job_cluster report it (100 MiB), read by the store.
SHAPE: dict[str, Any] = {
    "size_bytes": 100 << 20,
    "layers": 30,
    "context_length": 8192,
    "kv_bytes_per_token": 1024,
    "architecture": "",
}


def ticket(sha256: str, node_id: str) -> str:
    return f"ticket:{sha256[:4]}:{node_id}"


def coordinator(
    cluster: Cluster,
    *,
    store_port: int = STORE_PORT,
    signer: bool = True,
    primary_if_held: Any = None,
) -> TransferCoordinator:
    return TransferCoordinator(
        cluster.app,
        cluster.read,
        cluster.gateway,
        ticket if signer else None,
        primary_if_held=primary_if_held,
        clock=lambda: 100.0,
        store_port=store_port,
    )


def stored_row(cluster: Cluster, shape: dict[str, Any] = SHAPE) -> dict[str, Any]:
    """MODEL, now in the controller's model store (MODEL_STORED); the nodes that hold it
    proved so against the store's copy (when their claims agree with ``shape``)."""
    cluster.app.store_model(MODEL["name"], MODEL["sha256"], MODEL["file_name"], shape)
    if shape == SHAPE:
        cluster.prove_against_store()
    row = cluster.read.get_model(MODEL["name"])
    assert row is not None and row["stored"] == shape
    return row


def plain_row(cluster: Cluster) -> dict[str, Any]:
    row = cluster.read.get_model(MODEL["name"])
    assert row is not None and row["stored"] is None
    return row


async def test_the_store_is_a_source_named_controller_with_a_ticket() -> None:
    cluster = Cluster(nodes=0)
    c = lacking(cluster, "c")
    row = stored_row(cluster)
    (pull,) = coordinator(cluster).pull(row, [c])
    ((node, request),) = cluster.gateway.fetches
    assert node == c and pull.node_id == c
    assert request.sources == (
        TransferSource(CONTROLLER_SOURCE_ID, "", STORE_PORT, ticket(MODEL["sha256"], c)),
    )
    assert CONTROLLER_SOURCE_ID == "controller"
    assert pull.sources == ("controller",)
    assert request.size_bytes == SHAPE["size_bytes"]  # no node holds it: the store's size
    assert (request.sha256, request.file_name) == (MODEL["sha256"], MODEL["file_name"])


async def test_the_size_is_the_stores_whatever_a_node_reports() -> None:
    """A node that reports the file with another size (100 MiB) than the store's copy has
    (60 MiB) is no source, and the fetch is sized as the store's copy."""
    cluster = Cluster(nodes=0)
    serving(cluster, "a")
    c = lacking(cluster, "c")
    (pull,) = coordinator(cluster).pull(stored_row(cluster, {**SHAPE, "size_bytes": 60 << 20}), [c])
    ((_, request),) = cluster.gateway.fetches
    assert request.size_bytes == 60 << 20
    assert pull.sources == ("controller",)


async def test_sources_are_ordered_by_uploads_peers_first_on_a_tie_urls_last() -> None:
    cluster = Cluster(nodes=0)
    a, b = sorted(serving(cluster, "a", "b"))
    fetchers = [lacking(cluster, name) for name in ("c", "d", "e", "f")]
    cluster.app.add_model_source(MODEL["name"], URL)
    row = stored_row(cluster)
    transfers = coordinator(cluster)
    orders = []
    for node_id in fetchers:
        (pull,) = transfers.pull(row, [node_id])
        orders.append(pull.sources)
    assert orders == [
        (a, b, "controller", URL),  # nobody sends anything: peers before the store
        (b, "controller", a, URL),  # a sends one file
        ("controller", a, b, URL),  # a and b send one each
        (a, b, "controller", URL),  # everyone sends one: peers first again
    ]
    assert transfers.uploads == {a: 2, b: 1, "controller": 1}
    for node_id, request in cluster.gateway.fetches:
        served = [s for s in request.sources if not s.url]
        assert {s.ticket for s in served} == {ticket(MODEL["sha256"], node_id)}
        (url_source,) = [s for s in request.sources if s.url]
        assert (url_source.node_id, url_source.ticket) == ("", "")


async def test_a_busy_store_comes_after_an_idle_peer() -> None:
    cluster = Cluster(nodes=0)
    (a,) = serving(cluster, "a")
    c = lacking(cluster, "c")
    transfers = coordinator(cluster)
    transfers.uploads["controller"] = 3
    transfers.uploads[a] = 2
    (pull,) = transfers.pull(stored_row(cluster), [c])
    assert pull.sources == (a, "controller")


async def test_an_on_demand_fetch_from_the_store_alone() -> None:
    cluster = Cluster(nodes=0)
    c = lacking(cluster, "c")
    row = stored_row(cluster)
    asked: list[frozenset[str]] = []

    def primary_if_held(model: dict[str, Any], nodes: frozenset[str]) -> str | None:
        asked.append(nodes)
        return next(iter(nodes))

    assert not coordinator(cluster, store_port=0, primary_if_held=primary_if_held).fetch_for(row)
    assert not coordinator(cluster, signer=False, primary_if_held=primary_if_held).fetch_for(row)
    assert cluster.gateway.fetches == [] and asked == []
    transfers = coordinator(cluster, primary_if_held=primary_if_held)
    assert transfers.fetch_for(row)
    ((node, request),) = cluster.gateway.fetches
    assert node == c and asked == [frozenset({c})]
    assert [s.node_id for s in request.sources] == ["controller"]
    assert transfers.fetch_for(row)  # under way: the jobs wait
    assert len(cluster.gateway.fetches) == 1


async def test_no_on_demand_fetch_of_a_model_no_node_or_store_holds() -> None:
    cluster = Cluster(nodes=0)
    lacking(cluster, "c")
    transfers = coordinator(cluster, primary_if_held=lambda m, nodes: next(iter(nodes)))
    assert not transfers.fetch_for(plain_row(cluster))
    assert cluster.gateway.fetches == []


async def test_a_pull_onto_several_nodes_with_one_disconnected_asks_none() -> None:
    cluster = Cluster(nodes=0)
    serving(cluster, "a")
    c, d, e = lacking(cluster, "c"), lacking(cluster, "d"), lacking(cluster, "e")
    cluster.gateway.disconnected.add(e)
    transfers = coordinator(cluster)
    with pytest.raises(TransferRefused, match=f"node {e} is not connected"):
        transfers.pull(stored_row(cluster), [c, d, e])
    assert cluster.gateway.fetches == []
    assert transfers.running == {} and +transfers.uploads == {}
    pulls = transfers.pull(stored_row(cluster), [c, d])  # without it: both
    assert [p.node_id for p in pulls] == [c, d]


async def test_a_url_only_model_is_pulled_without_a_signer() -> None:
    cluster = Cluster(nodes=0)
    serving(cluster, "a")  # a node holds it, but without tickets it cannot serve it
    c = lacking(cluster, "c")
    cluster.app.add_model_source(MODEL["name"], URL)
    row = stored_row(cluster)  # stored too: not served without a signer either
    transfers = coordinator(cluster, signer=False)
    (pull,) = transfers.pull(row, [c])
    ((_, request),) = cluster.gateway.fetches
    assert pull.sources == (URL,)
    assert request.sources == (TransferSource("", "", 0, "", URL),)


async def test_a_model_without_url_is_refused_naming_the_missing_ca() -> None:
    cluster = Cluster(nodes=0)
    c = lacking(cluster, "c")
    transfers = coordinator(cluster, signer=False)
    with pytest.raises(TransferRefused, match=r"no http\(s\) source.*cannot sign.*TLS"):
        transfers.pull(plain_row(cluster), [c])
    with pytest.raises(TransferRefused, match="cannot sign"):
        transfers.pull(stored_row(cluster), [c])  # its store cannot serve without tickets
    assert cluster.gateway.fetches == []


async def test_a_model_nobody_holds_is_refused_naming_the_store() -> None:
    cluster = Cluster(nodes=0)
    c = lacking(cluster, "c")
    with pytest.raises(TransferRefused, match="model store does not hold it"):
        coordinator(cluster).pull(plain_row(cluster), [c])
    with pytest.raises(TransferRefused, match="model store does not hold it"):
        coordinator(cluster, store_port=0).pull(stored_row(cluster), [c])  # not served


async def test_stores_needs_a_port_a_signer_and_a_stored_file() -> None:
    cluster = Cluster(nodes=0)
    plain = plain_row(cluster)
    row = stored_row(cluster)
    assert coordinator(cluster).stores(row)
    assert not coordinator(cluster, store_port=0).stores(row)
    assert not coordinator(cluster, signer=False).stores(row)
    assert not coordinator(cluster).stores(plain)
    cluster.app.unstore_model(MODEL["name"])
    unstored = cluster.read.get_model(MODEL["name"])
    assert unstored is not None and not coordinator(cluster).stores(unstored)


class _NoServer:
    """Stands in for ModelFileServer: binds nothing, records what it was asked."""

    made: list[tuple[str, int]] = []

    def __init__(self, host: str, port: int, *args: object) -> None:
        _NoServer.made.append((host, port))
        self.port = port or 43210  # what binding port 0 gives: some free port
        self.revoked: list[str] = []

    def revoke(self, node_ids: Iterable[str]) -> None:
        self.revoked.extend(node_ids)

    def start(self) -> _NoServer:
        return self


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    monkeypatch.setattr(model_store_server, "ModelFileServer", _NoServer)
    monkeypatch.setattr(_NoServer, "made", [])
    return _NoServer.made


@pytest.fixture
def own_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServerTls:
    monkeypatch.setattr(tls_module, "local_names", lambda: (["dacp-controller"], ["127.0.0.1"]))
    return tls_module.load_or_create(tmp_path / "tls")


@pytest.mark.parametrize(("raw", "port"), [("", 50054), ("0", 0), ("50099", 50099)])
def test_the_store_is_served_on_model_store_port_0_any_free_one(
    raw: str, port: int, tmp_path: Path, no_server: list[tuple[str, int]], own_ca: ServerTls
) -> None:
    settings = Settings.from_env({"DACP_VAR_DIR": str(tmp_path), "MODEL_STORE_PORT": raw})
    assert settings.model_store_port == port
    server = model_store_server.start_store_server(settings, own_ca, ["n-revoked"])
    assert isinstance(server, _NoServer)
    assert no_server == [("127.0.0.1", port)]
    assert server.revoked == ["n-revoked"] and server.port > 0


def test_the_store_is_not_served_when_off_or_without_a_ca_of_its_own(
    tmp_path: Path, no_server: list[tuple[str, int]], own_ca: ServerTls
) -> None:
    off = Settings.from_env({"DACP_VAR_DIR": str(tmp_path), "MODEL_STORE_PORT": "off"})
    assert off.model_store_port is None
    assert model_store_server.start_store_server(off, own_ca, []) is None
    served = Settings.from_env({"DACP_VAR_DIR": str(tmp_path)})
    assert model_store_server.start_store_server(served, None, []) is None
    operators = dataclasses.replace(own_ca, ca_key_pem=None)  # the operator's TLS files
    assert model_store_server.start_store_server(served, operators, []) is None
    assert no_server == []
