"""The committed generated modules must match a fresh `python -m wire.generate`."""

from __future__ import annotations

from pathlib import Path

import pytest

import wire
from common import contract
from wire import generate as gen

PROTO_DIR = Path(wire.__file__).resolve().parent


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("proto-gen")
    gen.generate(out)
    return out


@pytest.mark.parametrize("name", gen.GENERATED_FILES)
def test_committed_module_matches_fresh_generation(fresh: Path, name: str) -> None:
    committed = PROTO_DIR / name
    assert committed.is_file(), f"{committed} missing: run `python -m wire.generate`"
    assert committed.read_bytes() == (fresh / name).read_bytes(), (
        f"{committed} drifted from wire/control.proto: run `python -m wire.generate` "
        "(or `make proto`) and commit the result"
    )


def test_generation_is_deterministic(fresh: Path, tmp_path: Path) -> None:
    gen.generate(tmp_path)
    for name in gen.GENERATED_FILES:
        assert (tmp_path / name).read_bytes() == (fresh / name).read_bytes(), name


def test_grpc_module_imports_pb2_package_relative(fresh: Path) -> None:
    text = (fresh / "control_pb2_grpc.py").read_text(encoding="utf-8")
    assert "from . import control_pb2 as control__pb2" in text
    assert "\nimport control_pb2" not in text


def test_generated_modules_import_from_repo_root() -> None:
    from wire import control_pb2, control_pb2_grpc

    assert control_pb2.DESCRIPTOR.package == contract.PROTOCOL_VERSION
    assert hasattr(control_pb2_grpc, "ControlPlaneStub")
    assert hasattr(control_pb2_grpc, "ControlPlaneServicer")
    assert hasattr(control_pb2_grpc, "add_ControlPlaneServicer_to_server")


def test_missing_proto_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(gen.GenerationError):
        gen.generate(tmp_path / "out", proto_dir=tmp_path)
