"""The agent's side of device plans: the llama-server and ggml-rpc-server command lines a plan
asks for (``--device``, ``--tensor-split``, ``--n-gpu-layers``, ``-d``), and out-of-memory as
llama.cpp prints it on each backend, blamed on the right node and device."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.out_of_memory import (
    Blame,
    MemoryFailure,
    PlanDevices,
    find_out_of_memory,
    out_of_memory,
    plan_devices,
    worker_out_of_memory,
)
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.runtime_errors import GenerationError, RuntimeCrashedError, RuntimeStartError
from agent.runtime.server_spec import server_spec_for
from common.contract import HOST_DEVICE
from wire import control_pb2 as pb

# What llama.cpp 11434 printed here: a llama-server whose RPC worker (under `ulimit -v`) could
# not allocate its share, and that worker's own output.
PRIMARY_RPC_OOM = [
    "0.00.181.816 E ggml_backend_buft_alloc_buffer_n_default: failed to allocate "
    "RPC0[127.0.0.1:50311] buffer of size 96576768",
    "0.00.199.583 E llama_model_load: error loading model: unable to allocate "
    "RPC0[127.0.0.1:50311] buffer",
    "0.00.199.623 E llama_model_load_from_file_impl: failed to load model",
    "0.00.200.175 E srv  llama_server: exiting due to model loading error",
]
WORKER_OOM = [
    "Starting RPC server v7.0.0",
    "Devices:",
    "  CPU: Intel(R) Xeon(R) Processor (24151 MiB, 24151 MiB free)",
    "ggml_aligned_malloc: insufficient memory (attempted to allocate  92.10 MB)",
    "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 96576768",
]


def plan(
    devices: list[tuple[str, str, str, float]], peers: list[tuple[str, str, int]]
) -> pb.ExecutionPlan:
    return pb.ExecutionPlan(
        job_id="j",
        model_file_name="m.gguf",
        context_size=2048,
        parallel=1,
        rpc_peers=[pb.RpcPeer(node_id=n, host=h, port=p) for n, h, p in peers],
        devices=[
            pb.PlanDevice(node_id=n, device=d, endpoint=e, share=s, assigned_bytes=1)
            for n, d, e, s in devices
        ],
    )


MIXED = plan(
    [
        ("primary", "CUDA0", "", 0.4),
        ("a", "CUDA0", "10.0.0.2:50052", 0.2),
        ("a", "CUDA1", "10.0.0.2:50052", 0.2),
        ("b", "CPU", "10.0.0.3:50052", 0.2),
    ],
    [("a", "10.0.0.2", 50052), ("b", "10.0.0.3", 50052)],
)


# ---------------------------------------------------------------------------------------------
# the command lines


def test_rpc_devices_are_numbered_in_rpc_order_then_in_each_workers_order() -> None:
    assert plan_devices(MIXED).names() == ("CUDA0", "RPC0", "RPC1", "RPC2")


def test_a_plan_with_devices_names_them_with_their_shares() -> None:
    spec = server_spec_for(MIXED, Path("/models/m.gguf"), slots=1, threads=None)
    argv = spec.argv(Path("llama-server"), "127.0.0.1", 8080)
    assert argv[argv.index("--device") + 1] == "CUDA0,RPC0,RPC1,RPC2"
    assert argv[argv.index("--tensor-split") + 1] == "0.4,0.2,0.2,0.2"
    assert argv[argv.index("--rpc") + 1] == "10.0.0.2:50052,10.0.0.3:50052"
    assert argv[argv.index("--n-gpu-layers") + 1] == "99"


def test_one_device_needs_no_split_and_a_partial_offload_says_how_many_layers() -> None:
    one = plan([("primary", "CUDA0", "", 1.0)], [])
    one.n_gpu_layers = 7
    argv = server_spec_for(one, Path("/m.gguf"), 1, None).argv(Path("s"), "127.0.0.1", 1)
    assert argv[argv.index("--device") + 1] == "CUDA0"
    assert "--tensor-split" not in argv and "--rpc" not in argv
    assert argv[argv.index("--n-gpu-layers") + 1] == "7"


def test_no_layer_on_a_gpu_is_device_none() -> None:
    cpu = plan([], [])
    cpu.n_gpu_layers = 0
    argv = server_spec_for(cpu, Path("/m.gguf"), 1, None).argv(Path("s"), "127.0.0.1", 1)
    assert argv[argv.index("--device") + 1] == "none"
    assert argv[argv.index("--n-gpu-layers") + 1] == "0"


def test_a_plan_from_before_devices_keeps_its_per_worker_split() -> None:
    old = plan([], [("a", "10.0.0.2", 50052), ("b", "10.0.0.3", 50052)])
    old.tensor_split.extend([0.5, 0.5])
    argv = server_spec_for(old, Path("/m.gguf"), 1, None).argv(Path("s"), "127.0.0.1", 1)
    assert "--device" not in argv
    assert argv[argv.index("--tensor-split") + 1] == "0.5,0.5"


@pytest.mark.parametrize(
    "bad",
    [
        plan([("a", "CUDA0", "10.0.0.9:1", 1.0)], [("a", "10.0.0.2", 50052)]),  # unknown endpoint
        plan([("p", "CUDA0,CUDA1", "", 1.0)], []),  # a list smuggled into a name
        plan([("p", "CUDA0", "", 0.5), ("p", "CUDA0", "", 0.5)], []),  # twice
    ],
)
def test_a_malformed_device_plan_is_refused(bad: pb.ExecutionPlan) -> None:
    with pytest.raises(ValueError, match="invalid execution plan"):
        server_spec_for(bad, Path("/m.gguf"), 1, None)


def test_an_rpc_worker_exposes_exactly_its_devices(tmp_path: Path) -> None:
    binaries = RuntimeBinaries(tmp_path, tmp_path / "llama-server", tmp_path / "ggml-rpc-server")
    worker = RpcWorker(binaries, "127.0.0.1", 50052, log_dir=tmp_path, devices=("CUDA1", "CPU"))
    argv = worker.argv()
    assert argv[argv.index("--device") + 1] == "CUDA1,CPU"
    assert "--device" not in RpcWorker(binaries, "127.0.0.1", 50052, log_dir=tmp_path).argv()
    with pytest.raises(ValueError, match="invalid device"):
        RpcWorker(binaries, "127.0.0.1", 50052, log_dir=tmp_path, devices=("CPU;rm",))


# ---------------------------------------------------------------------------------------------
# out of memory


def test_a_worker_that_could_not_take_its_share_is_blamed_from_the_primarys_output() -> None:
    failure = find_out_of_memory(PRIMARY_RPC_OOM)
    assert failure == MemoryFailure("RPC0[127.0.0.1:50311]", 96576768, PRIMARY_RPC_OOM[0])
    devices = plan_devices(
        plan([("w", HOST_DEVICE, "127.0.0.1:50311", 1.0)], [("w", "127.0.0.1", 50311)])
    )
    assert devices.blame(failure) == Blame("w", HOST_DEVICE, 96576768)


def test_a_buffer_is_named_for_its_servers_own_device_number() -> None:
    """llama.cpp names an RPC buffer RPC<i>[host:port], ``i`` counting that server's devices
    (seen here: --rpc A,B and ``failed to allocate RPC0[B] buffer`` for B's first device)."""
    failure = MemoryFailure("RPC0[10.0.0.3:50052]", 123, "")
    assert plan_devices(MIXED).blame(failure) == Blame("b", "CPU", 123)
    second = MemoryFailure("RPC1[10.0.0.2:50052]", 5, "")
    assert plan_devices(MIXED).blame(second) == Blame("a", "CUDA1", 5)
    # a bare device name counts over every server
    assert plan_devices(MIXED).blame(MemoryFailure("RPC2", 7, "")) == Blame("b", "CPU", 7)


def test_the_primarys_own_gpu_is_blamed_on_the_primary() -> None:
    lines = [
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 2048.00 MiB on device 0: "
        "cudaMalloc failed: out of memory",
        "alloc_tensor_range: failed to allocate CUDA0 buffer of size 2147483648",
        "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
    ]
    failure = find_out_of_memory(lines)
    assert failure is not None and failure.buffer == "CUDA0" and failure.bytes == 2147483648
    assert plan_devices(MIXED).blame(failure) == Blame("", "CUDA0", 2147483648)


@pytest.mark.parametrize(
    ("lines", "buffer", "size"),
    [
        (
            ["CUDA error: out of memory", "  current device: 1, in function x at y.cu:88"],
            "CUDA1",
            0,
        ),
        (["ROCm error: out of memory", "  current device: 0, in function x at y.cu:1"], "CUDA0", 0),
        (["ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory"], "", 0),
        (
            [
                "ggml_metal_buffer_init: failed to allocate Metal buffer of 1048576 bytes "
                "(out of memory)"
            ],
            "Metal",
            1048576,
        ),
        (["ggml_metal: error: failed to allocate buffer, size =   512.00 MiB"], "Metal", 512 << 20),
        (WORKER_OOM, HOST_DEVICE, 96576768),
        (["terminate called after throwing an instance of 'std::bad_alloc'"], "", 0),
        (["llama_init_from_model: failed to allocate buffer for kv cache"], "", 0),
    ],
)
def test_each_backends_out_of_memory_is_recognised(
    lines: list[str], buffer: str, size: int
) -> None:
    failure = find_out_of_memory(lines)
    assert failure is not None
    assert (failure.buffer, failure.bytes) == (buffer, size)


def test_other_failures_are_not_out_of_memory() -> None:
    assert find_out_of_memory(["error loading model: tensor 'x' has wrong shape"]) is None
    assert find_out_of_memory([]) is None


def test_a_worker_that_dies_starting_for_want_of_memory_names_its_device() -> None:
    exc = RuntimeStartError(
        "ggml-rpc-server exited", role="ggml-rpc-server", stderr_tail=WORKER_OOM
    )
    assert worker_out_of_memory(exc, ("CPU",)) == Blame("", "CPU", 96576768)
    assert worker_out_of_memory(exc, ("CUDA0", "CUDA1")) == Blame("", HOST_DEVICE, 96576768)
    other = RuntimeStartError("port in use", role="ggml-rpc-server", stderr_tail=["bind failed"])
    assert worker_out_of_memory(other, ("CPU",)) is None


def test_without_a_named_buffer_a_single_device_plan_blames_that_device() -> None:
    single = PlanDevices(
        plan([("w", "CUDA0", "10.0.0.2:50052", 1.0)], [("w", "10.0.0.2", 50052)]).devices,
        ("10.0.0.2:50052",),
    )
    assert single.blame(MemoryFailure("", 0, "")) == Blame("w", "CUDA0", 0)


class DeadServer:
    """A llama-server that died mid-generation: what it wrote last."""

    alive = False

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def tail(self, lines: int = 20) -> list[str]:
        return self.lines[-lines:]


def test_an_out_of_memory_mid_generation_is_read_from_the_dead_servers_output() -> None:
    cuda = ["CUDA error: out of memory", "  current device: 0, in function f at ggml-cuda.cu:88"]
    stream_broke = GenerationError("llama-server stream failed: connection reset")
    found = out_of_memory(stream_broke, plan_devices(MIXED), DeadServer(cuda))  # type: ignore[arg-type]
    assert found is not None and found[0] == Blame("", "CUDA0", 0)
    crashed = RuntimeCrashedError("llama-server exited", role="llama-server", stderr_tail=cuda)
    assert out_of_memory(crashed, plan_devices(MIXED)) == (Blame("", "CUDA0", 0), cuda[0])
    # a live server's refusal is not an out-of-memory unless it says so
    assert out_of_memory(GenerationError("HTTP 500: boom"), plan_devices(MIXED)) is None
