"""A plan's model file: found, verified once, trusted while unchanged, re-verified after."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from agent.runtime.job_messages import MODEL_NOT_FOUND, SHA256_MISMATCH, SetupFailure
from agent.runtime.plan_model import PlanModels
from tests.unit.test_agent_model_store import write_tiny_gguf


def _model(tmp_path: Path) -> tuple[PlanModels, str, str]:
    models, data = tmp_path / "models", tmp_path / "data"
    models.mkdir()
    data.mkdir()
    write_tiny_gguf(models / "m.gguf")
    sha = hashlib.sha256((models / "m.gguf").read_bytes()).hexdigest()
    return PlanModels(models, data), "m.gguf", sha


async def test_a_verified_file_is_trusted_without_a_thread_until_it_changes(
    tmp_path: Path,
) -> None:
    plans, name, sha = _model(tmp_path)
    assert plans.verified_before(name, sha) is None
    path = await plans.resolve(name, sha)
    assert plans.verified_before(name, sha) == path
    assert plans.verified_before(name, "0" * 64) is None  # another hash: not known
    write_tiny_gguf(path, layers=6)  # replaced in place by another model
    os.utime(path, ns=(1, 1))
    assert plans.verified_before(name, sha) is None
    with pytest.raises(SetupFailure) as refused:
        await plans.resolve(name, sha)
    assert refused.value.error_code == SHA256_MISMATCH


async def test_a_missing_file_is_model_not_found(tmp_path: Path) -> None:
    plans, _name, sha = _model(tmp_path)
    with pytest.raises(SetupFailure) as refused:
        await plans.resolve("absent.gguf", sha)
    assert refused.value.error_code == MODEL_NOT_FOUND
    path = await plans.resolve("m.gguf", sha)
    path.unlink()
    assert plans.verified_before("m.gguf", sha) is None
