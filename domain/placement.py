"""Scheduler and split planner as pure functions (see docs/architecture.md,
'Scheduling and split planning').

Given what a model needs and a snapshot of candidate nodes, ``plan_placement`` chooses the
primary (the node that runs ``llama-server`` and must hold the GGUF file), the RPC workers and
the tensor split. Nothing here reads a clock, touches the network or draws random numbers:
the caller builds the candidates from the eligibility read model plus live state and records
whatever comes back (``JOB_PLANNED`` or a 503, plus one ``SECURITY_VIOLATION`` per reported peer).

Rules, in the order they apply:

1. A candidate is *eligible* when its state is READY or DEGRADED, it has a free slot, its
   heartbeat is fresh, its usable memory is positive, its RPC port is a valid port and it is not
   in ``request.exclude``. Ineligible candidates are ignored silently.
2. An eligible candidate whose address is not an IP address inside ``allowed_peer_cidrs`` is
   excluded and reported as a :class:`PeerViolation`.
3. Plans are first sought among READY nodes only; DEGRADED nodes join the pool only when no plan
   exists without them (``fallback_used``).
4. Within a pool the plan uses the fewest nodes (at most ``max_nodes`` and at most the model's
   layer count). One node means no RPC at all. The primary must hold the model file; workers
   need not. Among plans of equal size the one with fewer DEGRADED nodes wins, then the one
   displacing fewer warm servers (``Candidate.warm``), then a READY primary, then the primary
   with most usable memory, then the smallest primary ``node_id``; workers are always the
   largest remaining nodes (usable memory descending, ties by ``node_id``).
5. The plan's ``parallel`` (llama-server slots, each with the full ``context_size``) is the
   most, up to the primary's ``slot_cap``, for which the chosen nodes still fit the model with
   ``context_size * parallel`` tokens of KV cache. Node choice comes first (fewest nodes with
   one slot), so memory is spent on slots only where no extra node is needed for it.
6. The tensor split is proportional to the chosen nodes' usable memory, quantised to
   ``1 / SPLIT_RESOLUTION`` by largest remainder, and capped so that every node's share of the
   required bytes (``fraction * required``, rounded up) never exceeds its usable memory. A set of
   nodes therefore fits when such a capped split exists, which is at most
   ``required / SPLIT_RESOLUTION`` bytes per node stricter than ``sum(usable) >= required``.

The result does not depend on the order of the candidates.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proto import DEFAULT_ALLOWED_PEER_CIDRS

MIB = 1024 * 1024
GIB = 1024 * MIB

READY = "READY"
DEGRADED = "DEGRADED"
ELIGIBLE_STATES = frozenset({READY, DEGRADED})

DEFAULT_HEADROOM_FRACTION = 0.10
DEFAULT_OVERHEAD_BYTES = 64 * MIB
DEFAULT_MAX_NODES = 8

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
#: The nodes that together would hold the model speak different llama.cpp RPC protocols.
RPC_VERSION_MISMATCH = "RPC_VERSION_MISMATCH"

#: Device kinds (``Device.kind``): a GPU (or other accelerator) and the host's CPU.
DEVICE_GPU = "gpu"
DEVICE_CPU = "cpu"
#: The host's CPU as llama.cpp names it (``ggml-rpc-server -d CPU``).
HOST_DEVICE = "CPU"

#: Plan tiers, best first (``ExecutionPlan.tier``): the order of preference the planner applies.
TIER_ONE_DEVICE = "one_device"
TIER_ONE_NODE_GPUS = "one_node_gpus"
TIER_GPUS_OVER_RPC = "gpus_over_rpc"
TIER_GPUS_AND_HOST = "gpus_and_host"
TIER_CPU = "cpu"
TIERS: tuple[str, ...] = (
    TIER_ONE_DEVICE,
    TIER_ONE_NODE_GPUS,
    TIER_GPUS_OVER_RPC,
    TIER_GPUS_AND_HOST,
    TIER_CPU,
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


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    needs: ModelNeeds
    context_size: int
    allowed_peer_cidrs: tuple[str, ...] = DEFAULT_ALLOWED_PEER_CIDRS
    max_nodes: int = DEFAULT_MAX_NODES
    exclude: frozenset[str] = frozenset()
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES

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


def address_allowed(address: str, cidrs: Iterable[str] = DEFAULT_ALLOWED_PEER_CIDRS) -> bool:
    """True when ``address`` is an IP literal inside one of ``cidrs``.

    Host names and malformed strings are never allowed; an IPv4-mapped IPv6 address is judged
    as its IPv4 address. A malformed CIDR raises ``ValueError``.
    """
    return _address_in(address, parse_cidrs(cidrs))


# ---------------------------------------------------------------------------------------------
# planning


def _ineligible(c: Candidate, exclude: frozenset[str]) -> bool:
    return (
        c.state not in ELIGIBLE_STATES
        or c.free_slots <= 0
        or not c.heartbeat_fresh
        or c.usable_memory_bytes <= 0
        or not 1 <= c.rpc_port <= 65535
        or c.node_id in exclude
    )


_node_id = operator.attrgetter("node_id")


def _by_memory(c: Candidate) -> tuple[int, str]:
    return (-c.usable_memory_bytes, c.node_id)


def _cap(usable: int, required: int) -> int:
    """Most split units a node may take without its share exceeding its usable memory."""
    return min(SPLIT_RESOLUTION, usable * SPLIT_RESOLUTION // required)


def _fits(usables: Iterable[int], required: int) -> bool:
    return sum(_cap(u, required) for u in usables) >= SPLIT_RESOLUTION


def split_units(usables: Sequence[int], required: int) -> tuple[int, ...]:
    """Integer split (summing to ``SPLIT_RESOLUTION``) proportional to ``usables``.

    Largest remainder, ties to the earlier entry, never above a node's cap. Raises
    ``ValueError`` if the nodes cannot hold ``required`` bytes.
    """
    if required <= 0:
        raise ValueError("required must be positive")
    if not usables or any(u <= 0 for u in usables):
        raise ValueError("usables must be non-empty and positive")
    caps = [_cap(u, required) for u in usables]
    if sum(caps) < SPLIT_RESOLUTION:
        raise ValueError("the nodes cannot hold the required bytes")
    total = sum(usables)
    parts = [u * SPLIT_RESOLUTION // total for u in usables]
    # proportional floor never exceeds the cap, because total >= required whenever caps fit
    parts = [min(p, cap) for p, cap in zip(parts, caps, strict=True)]
    order = sorted(
        range(len(usables)),
        key=lambda i: (-((usables[i] * SPLIT_RESOLUTION) % total), i),
    )
    left = SPLIT_RESOLUTION - sum(parts)
    while left > 0:
        for i in order:
            if left == 0:
                break
            if parts[i] < caps[i]:
                parts[i] += 1
                left -= 1
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class _Choice:
    key: tuple[int, int, int, int, str]
    primary: Candidate
    workers: tuple[Candidate, ...]


def _best_plan(pool: Sequence[Candidate], required: int, limit: int) -> _Choice | None:
    """Fewest nodes, then fewest DEGRADED, fewest warm servers displaced, READY primary,
    largest primary, smallest id."""
    primaries = sorted((c for c in pool if c.has_model), key=_by_memory)
    ranked: list[Candidate] = []  # everyone by memory; sorted only if one node is not enough
    for k in range(1, min(limit, len(pool)) + 1):
        best: _Choice | None = None
        if k == 2:
            ranked = sorted(pool, key=_by_memory)
        for p in primaries:
            p_degraded = int(p.state != READY)
            if k == 1:
                if _cap(p.usable_memory_bytes, required) >= SPLIT_RESOLUTION:
                    key = (p_degraded, int(p.warm), p_degraded, -p.usable_memory_bytes, p.node_id)
                    if best is None or key < best.key:
                        best = _Choice(key, p, ())
                continue
            others = [c for c in ranked if c.node_id != p.node_id]
            ready = [c for c in others if c.state == READY]
            degraded = [c for c in others if c.state != READY]
            for d in range(0, k):
                if k - 1 - d > len(ready) or d > len(degraded):
                    continue
                workers = sorted([*ready[: k - 1 - d], *degraded[:d]], key=_by_memory)
                if not _fits(
                    [p.usable_memory_bytes, *(w.usable_memory_bytes for w in workers)], required
                ):
                    continue
                warm = int(p.warm) + sum(int(w.warm) for w in workers)
                key = (d + p_degraded, warm, p_degraded, -p.usable_memory_bytes, p.node_id)
                if best is None or key < best.key:
                    best = _Choice(key, p, tuple(workers))
                break  # more DEGRADED workers for this primary can only rank lower
        if best is not None:
            return best
    return None


def _most_slots(request: PlacementRequest, choice: _Choice) -> tuple[int, int]:
    """(parallel, required bytes): the most slots up to the primary's cap that still fit."""
    usables = [c.usable_memory_bytes for c in (choice.primary, *choice.workers)]
    for parallel in range(min(max(1, choice.primary.slot_cap), MAX_SLOTS), 1, -1):
        required = required_bytes(
            request.needs,
            request.context_size * parallel,
            request.headroom_fraction,
            request.overhead_bytes,
        )
        if _fits(usables, required):
            return parallel, required
    return 1, request.required_bytes


def _fmt_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB ({n} bytes)"


def _best_capacity(pool: Sequence[Candidate], limit: int) -> int:
    """Most memory a plan of at most ``limit`` nodes with a file-holding primary can gather."""
    ranked = sorted(pool, key=_by_memory)
    best = 0
    for p in ranked:
        if not p.has_model:
            continue
        others = [c.usable_memory_bytes for c in ranked if c.node_id != p.node_id]
        best = max(best, p.usable_memory_bytes + sum(others[: limit - 1]))
    return best


def _no_capacity(
    request: PlacementRequest,
    pool: Sequence[Candidate],
    required: int,
    limit: int,
    considered: int,
) -> NoCapacity:
    needs = request.needs
    model = f"model {needs.name} (sha256 {needs.sha256})"
    if not pool:
        return NoCapacity(
            reason=(
                f"no eligible node for {model}: none of {considered} candidate(s) is READY or "
                "DEGRADED with a free slot, a fresh heartbeat, usable memory and an allowed "
                "address"
            ),
            code=NO_ELIGIBLE_NODES,
            needed_bytes=required,
            available_bytes=0,
        )
    if not any(c.has_model for c in pool):
        return NoCapacity(
            reason=f"no eligible node holds {model}",
            code=MODEL_NOT_PRESENT,
            needed_bytes=required,
            available_bytes=0,
        )
    available = _best_capacity(pool, limit)
    total = sum(c.usable_memory_bytes for c in pool)
    context = f"with context {request.context_size}"
    if _fits((c.usable_memory_bytes for c in pool), required) and len(pool) > limit:
        return NoCapacity(
            reason=(
                f"{model} {context} needs {_fmt_bytes(required)}; the {len(pool)} eligible "
                f"nodes have {_fmt_bytes(total)} together, but a plan may use at most {limit} "
                f"node(s) (max_nodes {request.max_nodes}, model layers {needs.layers}), which "
                f"gather at most {_fmt_bytes(available)}"
            ),
            code=NODE_LIMIT,
            needed_bytes=required,
            available_bytes=available,
        )
    if available >= required:
        return NoCapacity(
            reason=(
                f"{model} {context} needs {_fmt_bytes(required)}; the best plan over up to "
                f"{min(limit, len(pool))} of the {len(pool)} eligible node(s) gathers "
                f"{_fmt_bytes(available)}, which leaves no room for rounding the tensor split "
                f"to 1/{SPLIT_RESOLUTION} without exceeding a node's usable memory"
            ),
            code=INSUFFICIENT_MEMORY,
            needed_bytes=required,
            available_bytes=available,
        )
    return NoCapacity(
        reason=(
            f"{model} {context} needs {_fmt_bytes(required)} but the best plan over up to "
            f"{min(limit, len(pool))} of the {len(pool)} eligible node(s) gathers only "
            f"{_fmt_bytes(available)}"
        ),
        code=INSUFFICIENT_MEMORY,
        needed_bytes=required,
        available_bytes=available,
    )


def _build_plan(request: PlacementRequest, choice: _Choice) -> ExecutionPlan:
    parallel, required = _most_slots(request, choice)
    chosen = (choice.primary, *choice.workers)
    units = split_units([c.usable_memory_bytes for c in chosen], required)
    nodes = [
        PlanNode(
            node_id=c.node_id,
            address=c.address,
            rpc_port=c.rpc_port,
            assigned_bytes=-(-u * required // SPLIT_RESOLUTION),
        )
        for c, u in zip(chosen, units, strict=True)
    ]
    needs = request.needs
    return ExecutionPlan(
        model_name=needs.name,
        model_sha256=needs.sha256,
        model_file_name=needs.file_name,
        context_size=request.context_size,
        required_bytes=required,
        primary=nodes[0],
        workers=tuple(nodes[1:]),
        tensor_split=tuple(u / SPLIT_RESOLUTION for u in units),
        parallel=parallel,
    )


def plan_placement(request: PlacementRequest, candidates: Iterable[Candidate]) -> PlacementResult:
    """Choose primary, workers and split for ``request`` (see the module docstring).

    Raises ``ValueError`` when two candidates share a ``node_id``.
    """
    ordered = sorted(candidates, key=_node_id)
    for a, b in itertools.pairwise(ordered):
        if a.node_id == b.node_id:
            raise ValueError(f"duplicate candidate node_id {a.node_id!r}")

    allowed_text = ", ".join(request.allowed_peer_cidrs)
    violations: list[PeerViolation] = []
    pool: list[Candidate] = []
    cidrs, exclude = request.allowed_peer_cidrs, request.exclude
    for c in ordered:
        if _ineligible(c, exclude):
            continue
        if _allowed(c.address, cidrs):
            pool.append(c)
            continue
        if _parse_address(c.address) is None:
            violations.append(
                PeerViolation(c.node_id, c.address, f"address {c.address!r} is not an IP address")
            )
            continue
        violations.append(
            PeerViolation(
                c.node_id,
                c.address,
                f"address {c.address} is outside the allowed peer networks ({allowed_text})",
            )
        )

    required = request.required_bytes
    limit = min(request.max_nodes, request.needs.layers)
    ready_pool = [c for c in pool if c.state == READY]

    fallback_used = False
    choice = _best_plan(ready_pool, required, limit)
    if choice is None and len(ready_pool) < len(pool):
        choice = _best_plan(pool, required, limit)
        fallback_used = choice is not None

    if choice is None:
        return PlacementResult(
            plan=None,
            no_capacity=_no_capacity(request, pool, required, limit, len(ordered)),
            violations=tuple(violations),
        )
    return PlacementResult(
        plan=_build_plan(request, choice),
        violations=tuple(violations),
        fallback_used=fallback_used,
    )


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
