"""A model the controller's store holds: MODEL_STORED with the file's shape on the aggregate
(domain/model.py) and in the ``models`` row (application/read_models.py), the scheduler's
fallback to that shape (application/scheduler.py: model_needs), and Controller.store_model /
unstore_model on an in-memory and a SQLite store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from application.controller import Controller
from application.errors import NotFound
from application.read_models import project_model
from application.scheduler import model_needs
from domain.catalog import code_of
from domain.errors import InvalidCommand
from domain.model import RegisteredModel, model_id
from infrastructure.persistence import persistence_env
from tests.unit.fakes import FakeReadModel

SHA = "a" * 64
OTHER_SHA = "b" * 64
SHAPE: dict[str, Any] = {
    "size_bytes": 100 << 20,
    "layers": 30,
    "context_length": 8192,
    "kv_bytes_per_token": 1024,
    "architecture": "llama",
}


def registered() -> RegisteredModel:
    return RegisteredModel.register("m", SHA, "m.gguf", 2048)


def events_of(model: RegisteredModel) -> list[Any]:
    """The events ``model`` recorded since last asked."""
    return list(model.collect_events())


def codes(model: RegisteredModel) -> list[str]:
    return [code_of(e) for e in events_of(model)]


def row_after(events: list[Any]) -> dict[str, Any]:
    row: dict[str, Any] | None = None
    for event in events:
        row = project_model(row, event)
    assert row is not None
    return row


# --- the aggregate ---------------------------------------------------------------------


def test_store_records_model_stored_with_the_shape() -> None:
    model = registered()
    assert model.stored is None
    assert model.store(**SHAPE) is True
    events = events_of(model)
    assert [code_of(e) for e in events] == ["MODEL_REGISTERED", "MODEL_STORED"]
    stored = events[-1]
    assert isinstance(stored, RegisteredModel.Stored)
    assert (stored.size_bytes, stored.layers, stored.context_length) == (100 << 20, 30, 8192)
    assert (stored.kv_bytes_per_token, stored.architecture) == (1024, "llama")
    assert model.stored == SHAPE


def test_storing_the_identical_shape_again_records_nothing() -> None:
    model = registered()
    model.store(**SHAPE)
    events_of(model)
    assert model.store(**SHAPE) is False
    assert codes(model) == []
    assert model.store(**{**SHAPE, "layers": 31}) is True  # another shape is news
    assert codes(model) == ["MODEL_STORED"]
    assert model.stored == {**SHAPE, "layers": 31}


@pytest.mark.parametrize(
    "bad",
    [{"size_bytes": 0}, {"layers": -1}, {"context_length": -1}, {"kv_bytes_per_token": -1}],
)
def test_a_shape_that_cannot_be_a_file_is_refused(bad: dict[str, int]) -> None:
    model = registered()
    events_of(model)
    with pytest.raises(InvalidCommand):
        model.store(**{**SHAPE, **bad})
    assert codes(model) == [] and model.stored is None


def test_unstore_needs_a_stored_model() -> None:
    model = registered()
    with pytest.raises(InvalidCommand, match="does not hold model m"):
        model.unstore()
    model.store(**SHAPE)
    model.unstore()
    assert model.stored is None
    assert codes(model) == ["MODEL_REGISTERED", "MODEL_STORED", "MODEL_UNSTORED"]
    with pytest.raises(InvalidCommand):
        model.unstore()
    assert model.store(**SHAPE) is True  # stored again after an unstore: recorded


def test_a_reregistration_with_another_file_clears_stored_on_aggregate_and_row() -> None:
    model = registered()
    model.store(**SHAPE)
    assert model.update(SHA, "m.gguf", 4096) is True  # same file, another context size
    assert model.stored == SHAPE
    before = events_of(model)
    assert row_after(before)["stored"] == SHAPE
    assert model.update(OTHER_SHA, "m2.gguf", 4096) is True
    assert model.stored is None
    after = events_of(model)
    row = row_after(before + after)
    assert row["stored"] is None and row["sha256"] == OTHER_SHA
    with pytest.raises(InvalidCommand):
        model.unstore()  # the store's copy is not the registered file's


def test_an_uppercase_reregistration_of_the_same_file_keeps_stored() -> None:
    model = registered()
    model.store(**SHAPE)
    model.update(SHA.upper(), "m.gguf", 4096)  # the sha256 is lowered before comparing
    assert model.stored == SHAPE
    assert row_after(events_of(model))["stored"] == SHAPE


def test_the_models_row_follows_stored_and_unstored() -> None:
    model = registered()
    registration = events_of(model)
    row = row_after(registration)
    assert row["stored"] is None
    model.store(**SHAPE)
    stored = events_of(model)
    row = row_after(registration + stored)
    assert row["stored"] == SHAPE
    assert row["updated_at"] == stored[0].timestamp.isoformat()
    assert row["name"] == "m" and row["sha256"] == SHA  # the rest of the row stays
    model.unstore()
    row = row_after(registration + stored + events_of(model))
    assert row["stored"] is None and row["sha256"] == SHA


def test_stored_and_unstored_without_a_row_make_none() -> None:
    model = registered()
    model.store(**SHAPE)
    model.unstore()
    _, stored, unstored = events_of(model)
    assert project_model(None, stored) is None
    assert project_model(None, unstored) is None


# --- the scheduler's needs ---------------------------------------------------------------


def model_row(stored: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "name": "m",
        "sha256": SHA,
        "file_name": "m.gguf",
        "context_size": 2048,
        "stored": stored,
    }


def node_holding(sha256: str, size: int, layers: int) -> dict[str, Any]:
    local = {"sha256": sha256, "size_bytes": size, "layers": layers, "context_length": 4096}
    return {"node_id": "n1", "local_models": [{**local, "kv_bytes_per_token": 512}]}


def test_needs_come_from_the_stored_shape() -> None:
    nodes = {"n1": node_holding(OTHER_SHA, 5, 5), "n2": {"node_id": "n2", "local_models": None}}
    needs = model_needs(model_row(SHAPE), nodes)
    assert needs is not None
    assert (needs.name, needs.sha256, needs.file_name) == ("m", SHA, "m.gguf")
    assert needs.weights_bytes == 100 << 20 and needs.layers == 30
    assert needs.kv_bytes_per_token == 1024 and needs.context_length_max == 8192


def test_a_nodes_report_never_changes_the_stored_shape() -> None:
    needs = model_needs(model_row(SHAPE), {"n1": node_holding(SHA, 7 << 20, 12)})
    assert needs is not None
    assert (needs.weights_bytes, needs.layers) == (100 << 20, 30)
    assert (needs.kv_bytes_per_token, needs.context_length_max) == (1024, 8192)


def test_no_needs_from_a_report_alone_nor_without_a_stored_file() -> None:
    assert model_needs(model_row(None), {"n1": node_holding(SHA, 5, 5)}) is None
    assert model_needs({k: v for k, v in model_row(None).items() if k != "stored"}, {}) is None


def test_a_stored_shape_without_layers_or_context_still_plans() -> None:
    shape = {**SHAPE, "layers": 0, "context_length": 0, "kv_bytes_per_token": 0}
    needs = model_needs(model_row(shape), {})
    assert needs is not None
    assert needs.layers == 1 and needs.context_length_max == 2048


# --- the controller ----------------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite"])
def app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Controller]:
    if request.param == "memory":
        controller = Controller()
    else:
        controller = Controller(env=persistence_env(None, var_dir=tmp_path / "var"))
    yield controller
    controller.close()


def model_codes(app: Controller, name: str = "m") -> list[str]:
    return [code_of(e) for e in app.events.get(model_id(name))]


def test_store_model_registers_a_new_model_and_stores_it_in_one_write(app: Controller) -> None:
    before = app.recorder.max_notification_id() or 0
    result = app.store_model("m", SHA, "m.gguf", SHAPE, 4096, "embedding", "mean")
    assert result.aggregate_id == model_id("m")
    assert model_codes(app) == ["MODEL_REGISTERED", "MODEL_STORED"]
    model: RegisteredModel = app.repository.get(model_id("m"))
    assert model.stored == SHAPE
    assert (model.context_size, model.kind, model.pooling) == (4096, "embedding", "mean")
    assert (app.recorder.max_notification_id() or 0) - before == 2
    row = FakeReadModel(app).get_model("m")
    assert row is not None and row["stored"] == SHAPE and row["kind"] == "embedding"


def test_store_model_updates_an_existing_model(app: Controller) -> None:
    app.register_model("m", SHA, "m.gguf", 2048)
    app.store_model("m", OTHER_SHA, "m2.gguf", SHAPE, 2048)
    assert model_codes(app) == ["MODEL_REGISTERED", "MODEL_UPDATED", "MODEL_STORED"]
    model: RegisteredModel = app.repository.get(model_id("m"))
    assert (model.sha256, model.file_name, model.stored) == (OTHER_SHA, "m2.gguf", SHAPE)
    app.store_model("m", OTHER_SHA, "m2.gguf", SHAPE, 2048)  # identical: nothing
    assert len(model_codes(app)) == 3
    row = FakeReadModel(app).get_model("m")
    assert row is not None and row["stored"] == SHAPE and row["sha256"] == OTHER_SHA


def test_a_refused_store_records_nothing_not_even_the_registration(app: Controller) -> None:
    with pytest.raises(InvalidCommand):
        app.store_model("m", SHA, "m.gguf", {**SHAPE, "size_bytes": 0})
    with pytest.raises(NotFound):
        app.unstore_model("m")  # the registration was not written either


def test_unstore_model(app: Controller) -> None:
    with pytest.raises(NotFound):
        app.unstore_model("unknown")
    app.register_model("m", SHA, "m.gguf", 2048)
    with pytest.raises(InvalidCommand):
        app.unstore_model("m")  # registered, not stored
    app.store_model("m", SHA, "m.gguf", SHAPE)
    app.unstore_model("m")
    assert model_codes(app)[-1] == "MODEL_UNSTORED"
    model: RegisteredModel = app.repository.get(model_id("m"))
    assert model.stored is None
    row = FakeReadModel(app).get_model("m")
    assert row is not None and row["stored"] is None
