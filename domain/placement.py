"""The vocabulary of placement: what a model needs, the candidates a plan is made of (nodes and
their devices), and the plan itself (primary, RPC workers, devices and shares), with the peer
address rules. The planner that chooses among them is :mod:`domain.split_planner`.

Nothing here reads a clock, touches the network or draws random numbers.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.contract import DEVICE_CPU as _DEVICE_CPU
from common.contract import DEVICE_GPU as _DEVICE_GPU
from common.contract import HOST_DEVICE as _HOST_DEVICE
from common.contract import MIB as MIB  # re-exported: the unit this module plans in
from domain.prefix_index import PrefixRoute
from domain.states import NodeState

GIB = 1024 * MIB

#: Node states a job may be placed on (DEGRADED only when READY nodes cannot hold it).
ELIGIBLE_STATES = frozenset({NodeState.READY, NodeState.DEGRADED})

DEFAULT_HEADROOM_FRACTION = 0.10
DEFAULT_OVERHEAD_BYTES = 64 * MIB
DEFAULT_MAX_NODES = 8
#: What each GPU of a plan keeps beyond its share of the layers: llama.cpp's compute buffers
#: (the logits of a 512-token micro-batch over a 128 k vocabulary alone are 256 MiB) and the
#: backend's own allocations. Its host's share is covered by ``overhead_bytes``.
DEFAULT_DEVICE_RESERVE_BYTES = 512 * MIB

SPLIT_RESOLUTION = 1_000_000
"""The tensor split is expressed in millionths (six decimal places)."""

#: What a node says of itself is its own (it runs the work), within sane bounds: at most this
#: many llama-server slots (the planner tries every count down from it) ...
MAX_SLOTS = 64
#: ... and at most this much usable memory, whatever it reports (16 TiB).
MAX_NODE_MEMORY_BYTES = 1 << 44


NO_ELIGIBLE_NODES = "NO_ELIGIBLE_NODES"
MODEL_NOT_PRESENT = "MODEL_NOT_PRESENT"
INSUFFICIENT_MEMORY = "INSUFFICIENT_MEMORY"
NODE_LIMIT = "NODE_LIMIT"
#: The warm server holding the job's conversation (its prompt's prefix) is busy: the job waits
#: for a slot there rather than take a free one elsewhere (application/prefix_routing.py).
WAITS_FOR_CACHE = "WAITS_FOR_CACHE"
#: The slowest link a split goes over by default, in Mbit/s (MIN_SPLIT_LINK_MBPS): below it a
#: split's setup sends gigabytes of weights for minutes, and every token waits on the link.
DEFAULT_MIN_SPLIT_LINK_MBPS = 50.0
#: Only a split over a link measured slower than MIN_SPLIT_LINK_MBPS would hold the model.
SLOW_LINK = "SLOW_LINK"
#: The nodes that together would hold the model speak different llama.cpp RPC protocols.
RPC_VERSION_MISMATCH = "RPC_VERSION_MISMATCH"

#: Device kinds (``Device.kind``), a GPU (or other accelerator) and the host's CPU, and the
#: host's CPU as llama.cpp names it: one definition, shared with the agent (``proto``).
DEVICE_GPU = _DEVICE_GPU
DEVICE_CPU = _DEVICE_CPU
HOST_DEVICE = _HOST_DEVICE

#: Plan tiers, best first (``ExecutionPlan.tier``): the order of preference the planner applies.
#: Every plan of one node comes before any split over several: a split over llama.cpp RPC
#: decodes slower than one node does, so where one node holds the model, more load gets
#: another replica on another node instead of a split.
TIER_ONE_DEVICE = "one_device"
TIER_ONE_NODE_GPUS = "one_node_gpus"
TIER_GPUS_AND_HOST = "gpus_and_host"
TIER_CPU = "cpu"
TIER_GPUS_OVER_RPC = "gpus_over_rpc"
TIER_CPU_OVER_RPC = "cpu_over_rpc"
TIERS: tuple[str, ...] = (
    TIER_ONE_DEVICE,
    TIER_ONE_NODE_GPUS,
    TIER_GPUS_AND_HOST,
    TIER_CPU,
    TIER_GPUS_OVER_RPC,
    TIER_CPU_OVER_RPC,
)

_IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


# ---------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True, slots=True)
class ModelNeeds:
    """What a model needs from the cluster, taken from the model registry (GGUF metadata)."""

    name: str
    sha256: str
    file_name: str
    weights_bytes: int
    layers: int
    kv_bytes_per_token: int
    context_length_max: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model name must not be empty")
        if not self.sha256:
            raise ValueError("model sha256 must not be empty")
        if not self.file_name:
            raise ValueError("model file name must not be empty")
        if self.weights_bytes <= 0:
            raise ValueError(f"weights_bytes must be positive, got {self.weights_bytes}")
        if self.layers <= 0:
            raise ValueError(f"layers must be positive, got {self.layers}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        if self.context_length_max <= 0:
            raise ValueError(f"context_length_max must be positive, got {self.context_length_max}")


def required_bytes(
    needs: ModelNeeds,
    context_size: int,
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
) -> int:
    """Bytes the whole cluster must provide to run ``needs`` with ``context_size`` tokens.

    ``(weights + kv_bytes_per_token * context_size) * (1 + headroom) + overhead``, rounded up.
    """
    if context_size <= 0:
        raise ValueError(f"context_size must be positive, got {context_size}")
    if not math.isfinite(headroom_fraction) or headroom_fraction < 0:
        raise ValueError(f"headroom_fraction must be finite and >= 0, got {headroom_fraction}")
    if overhead_bytes < 0:
        raise ValueError(f"overhead_bytes must be >= 0, got {overhead_bytes}")
    base = needs.weights_bytes + needs.kv_bytes_per_token * context_size
    return math.ceil(base * (1.0 + headroom_fraction)) + overhead_bytes


@dataclass(frozen=True, slots=True)
class Device:
    """A GPU (or other accelerator) of a node, as llama.cpp on that node names it.

    ``usable_bytes`` is what a plan may give it: its free memory less the controller's own
    reservations and any budget lowered after an out-of-memory (see the scheduler). The host's
    CPU is not a ``Device`` here: it is ``Candidate.usable_memory_bytes``."""

    name: str
    usable_bytes: int
    description: str = ""
    kind: str = DEVICE_GPU


@dataclass(frozen=True, slots=True)
class Link:
    """A link from one node to a peer, as the node measured it (``NODE_LINKS_MEASURED``)."""

    mbps: float
    rtt_ms: float


def link_between(a: Candidate, b: Candidate) -> Link | None:
    """The link between two nodes: the slower of the two directions measured (the lower
    bandwidth, the longer round trip), or None when neither node measured it."""
    found = [link for link in (a.links.get(b.node_id), b.links.get(a.node_id)) if link]
    if not found:
        return None
    return Link(min(x.mbps for x in found), max(x.rtt_ms for x in found))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node as the scheduler sees it at one instant.

    ``usable_memory_bytes`` is already ``min(read-model free, live free) - reservations``;
    ``has_model`` means the node holds a file whose sha256 is the model's.
    """

    node_id: str
    name: str
    state: str
    address: str
    rpc_port: int
    usable_memory_bytes: int
    free_slots: int
    has_model: bool
    heartbeat_fresh: bool
    #: Most llama-server slots this node offers as a primary (the agent's ``--slots``).
    slot_cap: int = 1
    #: The node keeps a warm llama-server (or RPC worker) that choosing it would displace.
    warm: bool = False
    #: Its GPUs, as its llama.cpp lists them (none on a CPU build).
    devices: tuple[Device, ...] = ()
    #: The ggml RPC protocol version its llama.cpp speaks ("" when it does not say); a split
    #: never mixes two.
    rpc_protocol: str = ""
    #: Its links to peers by node id, as it measured them (the planner prefers fast ones).
    links: Mapping[str, Link] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    needs: ModelNeeds
    context_size: int
    #: Where a plan's nodes may reach each other from: the controller's ALLOWED_PEER_CIDRS.
    allowed_peer_cidrs: tuple[str, ...]
    max_nodes: int = DEFAULT_MAX_NODES
    exclude: frozenset[str] = frozenset()
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES
    #: What each GPU keeps beyond its share (compute buffers): see DEFAULT_DEVICE_RESERVE_BYTES.
    device_reserve_bytes: int = DEFAULT_DEVICE_RESERVE_BYTES
    #: No split over a measured link slower than this (Mbit/s; 0: any link): MIN_SPLIT_LINK_MBPS.
    min_link_mbps: float = 0.0

    def __post_init__(self) -> None:
        # tolerate a list / set from configuration; keep the request hashable
        object.__setattr__(self, "allowed_peer_cidrs", tuple(self.allowed_peer_cidrs))
        object.__setattr__(self, "exclude", frozenset(self.exclude))
        if self.context_size <= 0:
            raise ValueError(f"context_size must be positive, got {self.context_size}")
        if self.context_size > self.needs.context_length_max:
            raise ValueError(
                f"context_size {self.context_size} exceeds the model's maximum context "
                f"{self.needs.context_length_max}"
            )
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if not self.allowed_peer_cidrs:
            raise ValueError("allowed_peer_cidrs must not be empty")
        if self.device_reserve_bytes < 0:
            raise ValueError(f"device_reserve_bytes must be >= 0, got {self.device_reserve_bytes}")
        parse_cidrs(self.allowed_peer_cidrs)  # raises ValueError on a bad entry
        required_bytes(self.needs, self.context_size, self.headroom_fraction, self.overhead_bytes)

    @property
    def required_bytes(self) -> int:
        return required_bytes(
            self.needs, self.context_size, self.headroom_fraction, self.overhead_bytes
        )


# ---------------------------------------------------------------------------------------------
# outputs


@dataclass(frozen=True, slots=True)
class PlanNode:
    node_id: str
    address: str
    rpc_port: int
    assigned_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "rpc_port": self.rpc_port,
            "assigned_bytes": self.assigned_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanNode:
        return cls(
            node_id=_get(data, "node_id", str),
            address=_get(data, "address", str),
            rpc_port=_get(data, "rpc_port", int),
            assigned_bytes=_get(data, "assigned_bytes", int),
        )


@dataclass(frozen=True, slots=True)
class PlanDevice:
    """One device of a plan and its share of the offloaded layers.

    ``via_rpc`` is False for the primary's own GPUs (``--device CUDA0``) and True for a device
    reached through a node's ``ggml-rpc-server`` (the primary's own CPU in a CPU split too)."""

    node_id: str
    device: str
    share: float
    assigned_bytes: int
    via_rpc: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "device": self.device,
            "share": self.share,
            "assigned_bytes": self.assigned_bytes,
            "via_rpc": self.via_rpc,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanDevice:
        via_rpc = data.get("via_rpc", True)
        share = data.get("share")
        if isinstance(share, bool) or not isinstance(share, int | float):
            raise ValueError("field 'share' must be a number")
        return cls(
            node_id=_get(data, "node_id", str),
            device=_get(data, "device", str),
            share=float(share),
            assigned_bytes=_get(data, "assigned_bytes", int),
            via_rpc=bool(via_rpc),
        )


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Primary, RPC workers and tensor split for one job.

    ``tensor_split`` lists the primary's fraction first, then each worker's in ``workers``
    order; every fraction is a multiple of ``1 / SPLIT_RESOLUTION`` and together they sum to 1.
    """

    model_name: str
    model_sha256: str
    model_file_name: str
    context_size: int
    required_bytes: int
    primary: PlanNode
    workers: tuple[PlanNode, ...]
    tensor_split: tuple[float, ...]
    #: llama-server slots (``--parallel``); each keeps ``context_size`` tokens of context.
    parallel: int = 1
    #: The devices the layers go to, in ``--device`` order (empty: the primary's CPU alone).
    devices: tuple[PlanDevice, ...] = ()
    #: Layers offloaded to ``devices`` (``--n-gpu-layers``); None: all of them. Fewer keeps
    #: the first layers in the primary's host memory (tier ``gpus_and_host``).
    n_gpu_layers: int | None = None
    #: Which of :data:`TIERS` the plan is; "" on a plan recorded before devices.
    tier: str = ""
    #: Why this plan: one line per choice the planner made, for JOB_PLANNED and the API.
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {self.parallel}")
        if self.devices:
            if not math.isclose(math.fsum(d.share for d in self.devices), 1.0, abs_tol=1e-6):
                raise ValueError("device shares must sum to 1")
            planned = set(self.node_ids)
            if any(d.node_id not in planned for d in self.devices):
                raise ValueError("a plan device belongs to a node outside the plan")
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise ValueError("n_gpu_layers must be >= 0")
        if len(self.tensor_split) != 1 + len(self.workers):
            raise ValueError("tensor_split must have one entry per node (primary first)")
        if any(not math.isfinite(f) or f < 0 for f in self.tensor_split):
            raise ValueError("tensor_split entries must be finite and >= 0")
        if not math.isclose(math.fsum(self.tensor_split), 1.0, abs_tol=1e-9):
            raise ValueError(f"tensor_split must sum to 1, got {math.fsum(self.tensor_split)}")
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("a node may appear only once in a plan")

    @property
    def nodes(self) -> tuple[PlanNode, ...]:
        """Primary first, then the workers."""
        return (self.primary, *self.workers)

    @property
    def primary_host_bytes(self) -> int:
        """The host memory the plan gives its primary's ``llama-server``: the whole plan's
        bytes on a plan without devices (the primary's CPU alone), else its devices' on the
        primary's host (``HOST_DEVICE``: layers kept in RAM, or its share of a CPU split)."""
        if not self.devices:
            return self.primary.assigned_bytes
        primary = self.primary.node_id
        return sum(
            d.assigned_bytes
            for d in self.devices
            if d.node_id == primary and d.device == HOST_DEVICE
        )

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(n.node_id for n in self.nodes)

    @property
    def assigned_bytes(self) -> dict[str, int]:
        return {n.node_id: n.assigned_bytes for n in self.nodes}

    @property
    def runtime_key(self) -> str:
        """Identifies the llama-server this plan runs on: the same key, the same server."""
        spec = (
            self.model_name,
            self.model_sha256,
            self.context_size,
            self.parallel,
            self.node_ids,
            tuple(round(f * SPLIT_RESOLUTION) for f in self.tensor_split),
            tuple((d.node_id, d.device, round(d.share * SPLIT_RESOLUTION)) for d in self.devices),
            self.n_gpu_layers,
        )
        return hashlib.sha256(repr(spec).encode()).hexdigest()[:20]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe primitives only (str, int, float, list, dict)."""
        return {
            "model_name": self.model_name,
            "model_sha256": self.model_sha256,
            "model_file_name": self.model_file_name,
            "context_size": self.context_size,
            "required_bytes": self.required_bytes,
            "primary": self.primary.to_dict(),
            "workers": [w.to_dict() for w in self.workers],
            "tensor_split": list(self.tensor_split),
            "parallel": self.parallel,
            "devices": [d.to_dict() for d in self.devices],
            "n_gpu_layers": self.n_gpu_layers,
            "tier": self.tier,
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecutionPlan:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on a malformed mapping."""
        if not isinstance(data, Mapping):
            raise ValueError("execution plan must be a mapping")
        primary = _get(data, "primary", Mapping)
        workers = _get(data, "workers", list)
        split = _get(data, "tensor_split", list)
        for w in workers:
            if not isinstance(w, Mapping):
                raise ValueError("execution plan workers must be mappings")
        for f in split:
            if isinstance(f, bool) or not isinstance(f, int | float):
                raise ValueError("tensor_split entries must be numbers")
        return cls(
            model_name=_get(data, "model_name", str),
            model_sha256=_get(data, "model_sha256", str),
            model_file_name=_get(data, "model_file_name", str),
            context_size=_get(data, "context_size", int),
            required_bytes=_get(data, "required_bytes", int),
            primary=PlanNode.from_dict(primary),
            workers=tuple(PlanNode.from_dict(w) for w in workers),
            tensor_split=tuple(float(f) for f in split),
            parallel=int(data.get("parallel", 1)),
            devices=tuple(PlanDevice.from_dict(d) for d in _devices(data.get("devices"))),
            n_gpu_layers=_optional_int(data.get("n_gpu_layers")),
            tier=str(data.get("tier") or ""),
            reasons=tuple(str(r) for r in data.get("reasons") or ()),
        )


@dataclass(frozen=True, slots=True)
class NoCapacity:
    """Why no plan exists. ``code`` is one of the module's ``NO_ELIGIBLE_NODES``,
    ``MODEL_NOT_PRESENT``, ``INSUFFICIENT_MEMORY`` or ``NODE_LIMIT``."""

    reason: str
    code: str = INSUFFICIENT_MEMORY
    needed_bytes: int | None = None
    available_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class PeerViolation:
    """An otherwise eligible node whose address lies outside the allowed peer networks."""

    node_id: str
    address: str
    reason: str


@dataclass(frozen=True, slots=True)
class PlacementResult:
    plan: ExecutionPlan | None
    no_capacity: NoCapacity | None = None
    violations: tuple[PeerViolation, ...] = ()
    fallback_used: bool = False
    #: The plan reuses a running server (``domain.runtimes.warm_choice``): no setup to redo.
    warm: bool = False
    #: The warm server was chosen for the prompt prefix it holds (``domain.prefix_index``).
    route: PrefixRoute | None = None

    def __post_init__(self) -> None:
        if (self.plan is None) == (self.no_capacity is None):
            raise ValueError("a placement result has exactly one of plan and no_capacity")

    @property
    def ok(self) -> bool:
        return self.plan is not None


# ---------------------------------------------------------------------------------------------
# addresses


def parse_cidrs(cidrs: Iterable[str]) -> tuple[_IPNetwork, ...]:
    """Parse CIDR strings (host bits allowed); raises ``ValueError`` on a bad entry."""
    return _parse_cidrs(tuple(cidrs))


@functools.lru_cache(maxsize=64)
def _parse_cidrs(cidrs: tuple[str, ...]) -> tuple[_IPNetwork, ...]:
    networks: list[_IPNetwork] = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"invalid CIDR {cidr!r}: {exc}") from None
    return tuple(networks)


@functools.lru_cache(maxsize=65536)  # pure; planning parses every node's address each time
def _parse_address(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _address_in(address: str, networks: Sequence[_IPNetwork]) -> bool:
    ip = _parse_address(address)
    return ip is not None and any(ip.version == n.version and ip in n for n in networks)


@functools.lru_cache(maxsize=65536)  # keyed by strings: cheap to hash, unlike networks
def _allowed(address: str, cidrs: tuple[str, ...]) -> bool:
    return _address_in(address, parse_cidrs(cidrs))


def address_allowed(address: str, cidrs: Iterable[str]) -> bool:
    """True when ``address`` is an IP literal inside one of ``cidrs``.

    Host names and malformed strings are never allowed; an IPv4-mapped IPv6 address is judged
    as its IPv4 address. A malformed CIDR raises ``ValueError``.
    """
    return _address_in(address, parse_cidrs(cidrs))


def _devices(value: Any) -> list[Mapping[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(d, Mapping) for d in value):
        raise ValueError("execution plan devices must be a list of mappings")
    return value


def _optional_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("n_gpu_layers must be an integer")
    return value


def _get(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data:
        raise ValueError(f"missing field {key!r}")
    value = data[key]
    if isinstance(value, bool) and kind is int:
        raise ValueError(f"field {key!r} must be an integer")
    if not isinstance(value, kind):
        raise ValueError(f"field {key!r} has the wrong type {type(value).__name__}")
    return value
