"""The ``llama-server`` an execution plan asks for: its command line (:class:`ServerSpec`;
equal specs share a warm server) and how a plan becomes one (:func:`server_spec_for`).

Agent code: imports only the standard library, third-party packages, ``proto`` and ``agent``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.runtime.endpoints import parse_endpoint, peer_endpoint
from agent.runtime.out_of_memory import PlanDevices
from common.contract import MIB, PROMPT_CACHE_BYTES
from wire import control_pb2 as pb

DEFAULT_CTX_SIZE = 4096
# With RPC workers every repeating layer goes to the workers unless the plan says otherwise.
RPC_DEFAULT_GPU_LAYERS = 99
# A llama.cpp device name: CUDA0, Vulkan1, Metal, RPC3, CPU (never a list separator).
DEVICE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
# llama-server verbosity 4 ("trace") logs device placement, buffer sizes and per-request timings.
DEFAULT_SERVER_VERBOSITY = 4
#: llama-server's ``--poll``: how long its idle compute threads spin for work before they sleep
#: (0 to 100; llama.cpp's own default is 50). 0: they sleep at once. Its threads take every core
#: by default, and while they spin between tokens the agent, and the controller on the same
#: machine, wait for a core to relay each token: on two cores 0 gave about 13 % more tokens a
#: second through the controller, and 12 % straight from llama-server (docs/performance.md).
DEFAULT_POLL = 0
#: llama-server's host-memory prompt cache at most (``--cache-ram``, MiB): llama.cpp's own
#: default. It saves a slot's prompt there when the slot takes another, so that a conversation
#: coming back finds it (the controller's prefix routing counts on it).
PROMPT_CACHE_MIB = PROMPT_CACHE_BYTES // MIB

# --- llama-server ------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """Everything that makes one ``llama-server`` instance; equal specs share a warm server.

    ``rpc_endpoints`` lists ``host:port`` of RPC workers. ``devices`` names the devices the
    layers go to (``--device``: the primary's own, ``CUDA0``, and its workers', ``RPC0``,
    ``RPC1``, ...), and ``tensor_split`` gives one proportion per device, in the same order;
    a plan from before devices gives one proportion per RPC worker instead. ``n_gpu_layers``
    defaults to all layers (99) when devices or RPC are used, so every repeating layer, the
    output layer and the KV cache live on them and the primary keeps only the token
    embeddings; a smaller number keeps the first layers in the primary's host memory, and 0
    without devices keeps every layer there (``--device none``: a GPU the plan does not use
    takes nothing). ``ctx_size`` is the total KV size shared by ``parallel`` slots.
    """

    model_path: str
    ctx_size: int = DEFAULT_CTX_SIZE
    rpc_endpoints: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    n_gpu_layers: int | None = None
    devices: tuple[str, ...] = ()
    parallel: int = 1
    threads: int | None = None
    #: ``--poll`` (0 to 100): see :data:`DEFAULT_POLL`.
    poll: int = DEFAULT_POLL
    alias: str | None = None
    extra_args: tuple[str, ...] = field(default=())
    #: ``--cache-ram`` (MiB; None: llama.cpp's default, 8192): see :func:`prompt_cache_mib`.
    #: Not part of what makes the server: a warm one serves plans that would size it otherwise.
    cache_ram_mib: int | None = field(default=None, compare=False)
    #: An embedding model's server: ``--embeddings``, its pooling ("": the model's own), and
    #: a batch as large as the context (a whole input is encoded in one batch).
    embeddings: bool = False
    pooling: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_path", str(Path(self.model_path).expanduser().resolve()))
        object.__setattr__(self, "rpc_endpoints", tuple(self.rpc_endpoints))
        object.__setattr__(self, "tensor_split", tuple(float(x) for x in self.tensor_split))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        object.__setattr__(self, "devices", tuple(self.devices))
        if self.ctx_size < 1:
            raise ValueError(f"ctx_size must be positive, got {self.ctx_size}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {self.parallel}")
        if self.cache_ram_mib is not None and self.cache_ram_mib < 0:
            raise ValueError(f"cache_ram_mib must be >= 0, got {self.cache_ram_mib}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not 0 <= self.poll <= 100:
            raise ValueError(f"poll must be 0 to 100, got {self.poll}")
        for endpoint in self.rpc_endpoints:
            parse_endpoint(endpoint)
        if len(set(self.rpc_endpoints)) != len(self.rpc_endpoints):
            raise ValueError("rpc_endpoints must be distinct")
        for device in self.devices:
            if not DEVICE_NAME.fullmatch(device):
                raise ValueError(f"invalid device name {device!r}")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("devices must be distinct")
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise ValueError(f"n_gpu_layers must be >= 0, got {self.n_gpu_layers}")
        if self.devices and self.tensor_split:
            _check_split(self.tensor_split, len(self.devices), "devices")
        elif self.tensor_split:
            if not self.rpc_endpoints:
                raise ValueError("tensor_split needs rpc_endpoints")
            _check_split(self.tensor_split, len(self.rpc_endpoints), "RPC workers")

    def argv(
        self, binary: Path, host: str, port: int, verbosity: int = DEFAULT_SERVER_VERBOSITY
    ) -> list[str]:
        argv = [str(binary), "--model", self.model_path, "--ctx-size", str(self.ctx_size)]
        argv += ["--host", host, "--port", str(port), "--parallel", str(self.parallel)]
        # The plan decides context, layers and split; don't let --fit second-guess it.
        argv += ["--fit", "off", "--no-webui", "--log-verbosity", str(verbosity)]
        # A chat server has no --kv-unified: each slot holds exactly ctx_size / parallel
        # tokens, the context the plan gives a job, so a longer prompt is refused (the
        # client's 400) instead of taking the cache the other slots' requests need. An
        # embedding server keeps one unified cache: its inputs are bounded by --ubatch-size
        # (the per-slot context) anyway, and a batch's vectors then equal each input's alone.
        if self.embeddings and self.parallel > 1:
            argv.append("--kv-unified")
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        argv += ["--poll", str(self.poll)]
        if self.cache_ram_mib is not None:
            argv += ["--cache-ram", str(self.cache_ram_mib)]
        if self.alias:
            argv += ["--alias", self.alias]
        if self.rpc_endpoints:
            argv += ["--rpc", ",".join(self.rpc_endpoints)]
        layers = self.n_gpu_layers
        if layers is None and (self.rpc_endpoints or self.devices):
            layers = RPC_DEFAULT_GPU_LAYERS
        if self.devices:
            argv += ["--device", ",".join(self.devices)]
        elif layers == 0:
            argv += ["--device", "none"]
        if layers is not None:
            argv += ["--n-gpu-layers", str(layers)]
        if self.tensor_split:
            argv += ["--tensor-split", ",".join(f"{x:g}" for x in self.tensor_split)]
        if self.embeddings:
            per_slot = str(max(1, self.ctx_size // self.parallel))
            argv += ["--embeddings", "--batch-size", per_slot, "--ubatch-size", per_slot]
            if self.pooling:
                argv += ["--pooling", self.pooling]
        argv += list(self.extra_args)
        return argv


def _check_split(split: tuple[float, ...], count: int, what: str) -> None:
    """Raises ``ValueError`` unless ``split`` has one proportion for each of the ``count``
    ``what`` (devices, RPC workers), each >= 0 and adding up to more than 0."""
    if len(split) != count:
        raise ValueError(f"tensor_split has {len(split)} entries for {count} {what}")
    if any(x < 0 for x in split) or sum(split) <= 0:
        raise ValueError("tensor_split proportions must be >= 0 with a positive sum")


def prompt_cache_mib(plan: pb.ExecutionPlan, free_bytes: int) -> int | None:
    """``--cache-ram`` for the server of ``plan`` on a node with ``free_bytes`` of host memory
    before it starts: half of what the plan leaves there, at most llama.cpp's default
    (:data:`PROMPT_CACHE_MIB`). None: the plan does not say what it gives the server (an older
    controller), so llama.cpp's default stands.

    The plan counts the weights and the slots' KV cache, not this cache, which llama-server
    fills as slots change hands: at its default of 8 GiB it could grow past what a node with
    little memory has, and the kernel's OOM killer would take the server with its jobs."""
    if not plan.HasField("host_bytes"):
        return None
    left = max(0, free_bytes - plan.host_bytes)
    return min(PROMPT_CACHE_MIB, left // 2 // MIB)


def server_spec_for(
    plan: pb.ExecutionPlan,
    model_path: Path,
    slots: int,
    threads: int | None,
    poll: int = DEFAULT_POLL,
) -> ServerSpec:
    """The server ``plan`` runs on, on a node offering ``slots``; raises ``ValueError`` saying
    what is wrong with the plan."""
    parallel = plan.parallel or 1
    if parallel > slots:
        raise ValueError(f"the plan asks for {parallel} slots; this node offers {slots}")
    endpoints = tuple(peer_endpoint(peer) for peer in plan.rpc_peers)
    try:
        devices: tuple[str, ...] = ()
        split = tuple(plan.tensor_split)
        if plan.devices:
            # The plan names each device and its share (--device, --tensor-split).
            devices = PlanDevices(plan.devices, endpoints).names()
            split = tuple(d.share for d in plan.devices) if len(devices) > 1 else ()
        return ServerSpec(
            model_path=str(model_path),
            # llama-server divides --ctx-size among its slots: each gets the plan's context.
            ctx_size=(plan.context_size or DEFAULT_CTX_SIZE) * parallel,
            rpc_endpoints=endpoints,
            tensor_split=split,
            n_gpu_layers=plan.n_gpu_layers if plan.HasField("n_gpu_layers") else None,
            devices=devices,
            parallel=parallel,
            threads=threads,
            poll=poll,
            embeddings=plan.embeddings,
            pooling=plan.pooling,
        )
    except ValueError as exc:
        raise ValueError(f"invalid execution plan: {exc}") from None
