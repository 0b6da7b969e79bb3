"""llama-server's host-memory prompt cache (``--cache-ram``) is sized to what its node has room
for: the plan says how much host memory it gives the server (``ExecutionPlan.host_bytes``), and
the agent gives the cache half of what that leaves, at most llama.cpp's default of 8 GiB. Left
at its default, the cache could grow past what a node with little memory has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.llama_handler import LlamaHandler
from agent.runtime.server_spec import (
    PROMPT_CACHE_MIB,
    ServerSpec,
    prompt_cache_mib,
    server_spec_for,
)
from common.contract import HOST_DEVICE
from domain.placement import ExecutionPlan, PlanDevice, PlanNode
from wire import control_pb2 as pb

GIB, MIB = 1 << 30, 1 << 20


def domain_plan(devices: tuple[PlanDevice, ...] = (), workers: int = 0) -> ExecutionPlan:
    nodes = [PlanNode(f"n{i}", f"10.0.0.{i + 1}", 50052, 3 * GIB) for i in range(1 + workers)]
    return ExecutionPlan(
        model_name="m",
        model_sha256="a" * 64,
        model_file_name="m.gguf",
        context_size=2048,
        required_bytes=3 * GIB * len(nodes),
        primary=nodes[0],
        workers=tuple(nodes[1:]),
        tensor_split=tuple(1 / len(nodes) for _ in nodes),
        devices=devices,
    )


def test_a_plan_on_the_primarys_cpu_gives_its_server_the_whole_plan_in_ram() -> None:
    assert domain_plan().primary_host_bytes == 3 * GIB


def test_a_gpu_plan_gives_the_server_only_the_layers_it_keeps_in_ram() -> None:
    on_gpu = domain_plan((PlanDevice("n0", "CUDA0", 1.0, 3 * GIB, False),))
    assert on_gpu.primary_host_bytes == 0
    partly = domain_plan(
        (
            PlanDevice("n0", "CUDA0", 0.75, 3 * GIB, False),
            PlanDevice("n0", HOST_DEVICE, 0.25, 1 * GIB, False),
        )
    )
    assert partly.primary_host_bytes == 1 * GIB


def test_a_cpu_split_gives_the_primary_its_own_share() -> None:
    split = domain_plan(
        (
            PlanDevice("n0", HOST_DEVICE, 0.5, 2 * GIB, True),
            PlanDevice("n1", HOST_DEVICE, 0.5, 4 * GIB, True),
        ),
        workers=1,
    )
    assert split.primary_host_bytes == 2 * GIB


def with_host_bytes(host: int | None) -> pb.ExecutionPlan:
    plan = pb.ExecutionPlan(job_id="j", model_file_name="m.gguf", context_size=2048, parallel=1)
    if host is not None:
        plan.host_bytes = host
    return plan


@pytest.mark.parametrize(
    ("host", "free", "mib"),
    [
        (3 * GIB, 8 * GIB, 2560),  # half of the 5 GiB left
        (0, 64 * GIB, PROMPT_CACHE_MIB),  # llama.cpp's default at most
        (6 * GIB, 4 * GIB, 0),  # no room left: no cache
        (None, 8 * GIB, None),  # an older controller's plan: llama.cpp's default stands
    ],
)
def test_the_cache_gets_half_of_what_the_plan_leaves(
    host: int | None, free: int, mib: int | None
) -> None:
    assert prompt_cache_mib(with_host_bytes(host), free) == mib


def test_the_server_is_started_with_it_and_a_warm_one_is_reused_whatever_it_got() -> None:
    spec = server_spec_for(with_host_bytes(0), Path("/m.gguf"), slots=1, threads=None)
    assert "--cache-ram" not in spec.argv(Path("s"), "127.0.0.1", 1)
    sized = ServerSpec(spec.model_path, spec.ctx_size, cache_ram_mib=512)
    argv = sized.argv(Path("s"), "127.0.0.1", 1)
    assert argv[argv.index("--cache-ram") + 1] == "512"
    assert sized == spec and hash(sized) == hash(spec)  # the same server
    with pytest.raises(ValueError, match="cache_ram_mib"):
        ServerSpec("/m.gguf", cache_ram_mib=-1)


class RecordingRuntime:
    """The runtime manager's part the handler asks for a server: the specs it is given."""

    server = None

    def __init__(self) -> None:
        self.specs: list[ServerSpec] = []

    def ensure_server(self, spec: ServerSpec) -> Any:
        self.specs.append(spec)
        return object()

    def close(self) -> None:
        pass


def handler_for(tmp_path: Path, memory_limit_bytes: int) -> LlamaHandler:
    fake = tmp_path / "bin"  # never executed by these tests
    binaries = RuntimeBinaries(fake, fake / "llama-server", fake / "ggml-rpc-server")
    return LlamaHandler(
        binaries,
        models_dir=tmp_path,
        data_dir=tmp_path,
        log_dir=tmp_path,
        memory_limit_bytes=memory_limit_bytes,
    )


async def test_the_agent_sizes_a_server_it_starts_from_what_its_node_has_free(
    tmp_path: Path,
) -> None:
    handler = handler_for(tmp_path, 6 * GIB)
    try:
        runtime = RecordingRuntime()
        handler.runtime = runtime  # type: ignore[assignment]
        handler._free_host_bytes = lambda: 6 * GIB  # type: ignore[method-assign]
        plan = with_host_bytes(2 * GIB)
        spec = server_spec_for(plan, Path("/m.gguf"), slots=1, threads=None)
        handler._ensure_server(spec, False, plan)
        assert runtime.specs[-1].cache_ram_mib == 2048  # half of the 4 GiB left
    finally:
        await handler.close()


async def test_the_node_limit_caps_what_counts_as_free(tmp_path: Path) -> None:
    handler = handler_for(tmp_path, MIB)  # the node offers less than the system has free
    try:
        assert handler._free_host_bytes() == MIB
    finally:
        await handler.close()
