"""Execution plans for tests that record jobs without going through the scheduler."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from domain.placement import ExecutionPlan, PlanNode


def one_node_plan(
    node_id: UUID | str, *, model: str = "m", parallel: int = 1, context_size: int = 2048
) -> dict[str, Any]:
    """A valid plan (``ExecutionPlan.to_dict``) running ``model`` on ``node_id`` alone."""
    return ExecutionPlan(
        model_name=model,
        model_sha256="a" * 64,
        model_file_name=f"{model}.gguf",
        context_size=context_size,
        required_bytes=1,
        primary=PlanNode(str(node_id), "10.0.0.9", 50052, 1),
        workers=(),
        tensor_split=(1.0,),
        parallel=parallel,
    ).to_dict()
