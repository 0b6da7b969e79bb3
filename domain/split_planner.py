"""The split planner: which devices of which nodes run a model, and each one's share (see
docs/request-flow.md, '3. Scheduling').

Given what a model needs and a snapshot of candidate nodes (:mod:`domain.placement`),
:func:`plan_placement` chooses the primary (the node that runs ``llama-server`` and must hold
the GGUF file), the devices the layers go to, each device's share, and the RPC workers that
expose remote devices. A pure function: the caller builds the candidates from the eligibility
read model plus live state and records whatever comes back (``JOB_PLANNED`` with the plan's
reasons, or a 503, plus one ``SECURITY_VIOLATION`` per reported peer).

Memory. A plan needs ``required`` bytes: the weights plus the KV cache of every slot
(``kv_bytes_per_token`` from the GGUF, times context, times slots), with a headroom fraction
and the host's compute overhead. Each GPU that takes a share also keeps
``device_reserve_bytes`` for its own compute buffers, so a GPU's *room* for layers is its
usable memory less that reserve. Shares are in millionths; a device's share of ``required``
(rounded up) plus its reserve never exceeds its usable memory.

Rules, in the order they apply:

1. A candidate is *eligible* when its state is READY or DEGRADED, it has a free slot, its
   heartbeat is fresh, its usable host memory is positive, its RPC port is a valid port and it
   is not in ``request.exclude``. Ineligible candidates are ignored silently.
2. An eligible candidate whose address is not an IP address inside ``allowed_peer_cidrs`` is
   excluded and reported as a :class:`PeerViolation`.
3. Plans are first sought among READY nodes only; DEGRADED nodes join the pool only when no plan
   exists without them (``fallback_used``).
4. Within a pool, the first tier (:data:`TIERS`) that has a plan wins. Every plan of one node
   comes first: a split over llama.cpp RPC decodes slower than one node, so where one node
   holds the model a second replica (another job's plan on another node) serves more load than
   a split would:

   1. ``one_device``: one GPU of the primary holds everything;
   2. ``one_node_gpus``: several GPUs of the primary;
   3. ``gpus_and_host``: the primary's GPUs take the last ``n_gpu_layers`` layers and its host
      memory the rest (one node: a box with a small GPU and much RAM);
   4. ``cpu``: the primary's host memory only;
   5. ``gpus_over_rpc``: GPUs of several nodes, the workers' reached over RPC (the primary may
      have none);
   6. ``cpu_over_rpc``: host memory split over several nodes' ``ggml-rpc-server``.

5. Within a tier the plan uses the fewest nodes (at most ``max_nodes`` and at most the model's
   layer count), and all of them speak one RPC protocol (``Candidate.rpc_protocol``). Among
   plans of equal size the one with fewer DEGRADED nodes wins, then the one displacing fewer warm
   servers, then the one with fewer devices (more layers on GPUs in ``gpus_and_host``), then a
   READY primary, then the primary with most room, then the smallest primary ``node_id``; workers
   are always the roomiest remaining nodes (ties by ``node_id``), and within the chosen nodes the
   fewest, roomiest devices that hold the model take it.
6. The plan's ``parallel`` (llama-server slots, each with the full ``context_size``) is the most,
   up to the primary's ``slot_cap``, for which the chosen nodes still hold the model in the same
   tier with ``context_size * parallel`` tokens of KV cache.
7. Shares are proportional to room, quantised to ``1 / SPLIT_RESOLUTION`` by largest remainder
   and capped so that no device (or host) takes more than it has (:func:`split_units`).

When the nodes that could hold the model together speak different RPC protocols, the refusal
says so (``RPC_VERSION_MISMATCH``) instead of planning a split that would fail at load.

The result does not depend on the order of the candidates.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from domain.placement import (
    DEVICE_GPU,
    ELIGIBLE_STATES,
    GIB,
    HOST_DEVICE,
    INSUFFICIENT_MEMORY,
    MAX_SLOTS,
    MIB,
    MODEL_NOT_PRESENT,
    NO_ELIGIBLE_NODES,
    NODE_LIMIT,
    RPC_VERSION_MISMATCH,
    SLOW_LINK,
    SPLIT_RESOLUTION,
    TIER_CPU,
    TIER_CPU_OVER_RPC,
    TIER_GPUS_AND_HOST,
    TIER_GPUS_OVER_RPC,
    TIER_ONE_DEVICE,
    TIER_ONE_NODE_GPUS,
    TIERS,
    Candidate,
    ExecutionPlan,
    NoCapacity,
    PeerViolation,
    PlacementRequest,
    PlacementResult,
    PlanDevice,
    PlanNode,
    _allowed,
    _parse_address,
    link_between,
    required_bytes,
)
from domain.states import NodeState

RES = SPLIT_RESOLUTION


# ---------------------------------------------------------------------------------------------
# splitting bytes over devices


def _cap(room: int, required: int) -> int:
    """Most split units a device may take without its share exceeding its room."""
    return min(RES, room * RES // required) if room > 0 else 0


def _fits(rooms: Iterable[int], required: int) -> bool:
    return sum(_cap(r, required) for r in rooms) >= RES


def split_units(usables: Sequence[int], required: int) -> tuple[int, ...]:
    """Integer split (summing to ``SPLIT_RESOLUTION``) proportional to ``usables``.

    Largest remainder, ties to the earlier entry, never above an entry's cap. Raises
    ``ValueError`` if the entries cannot hold ``required`` bytes.
    """
    if required <= 0:
        raise ValueError("required must be positive")
    if not usables or any(u <= 0 for u in usables):
        raise ValueError("usables must be non-empty and positive")
    caps = [_cap(u, required) for u in usables]
    if sum(caps) < RES:
        raise ValueError("the nodes cannot hold the required bytes")
    total = sum(usables)
    parts = [u * RES // total for u in usables]
    # proportional floor never exceeds the cap, because total >= required whenever caps fit
    parts = [min(p, cap) for p, cap in zip(parts, caps, strict=True)]
    order = sorted(range(len(usables)), key=lambda i: (-((usables[i] * RES) % total), i))
    left = RES - sum(parts)
    while left > 0:
        for i in order:
            if left == 0:
                break
            if parts[i] < caps[i]:
                parts[i] += 1
                left -= 1
    return tuple(parts)


def _share_bytes(units: int, required: int) -> int:
    return -(-units * required // RES)


# ---------------------------------------------------------------------------------------------
# devices and rooms


@dataclass(frozen=True, slots=True)
class _Gpu:
    node_id: str
    name: str
    usable: int
    #: Bytes for layers: usable less the compute reserve.
    room: int


def _gpus(c: Candidate, reserve: int) -> tuple[_Gpu, ...]:
    """The candidate's GPUs with room for layers, roomiest first (ties by name)."""
    gpus = [
        _Gpu(c.node_id, d.name, d.usable_bytes, d.usable_bytes - reserve)
        for d in c.devices
        if d.kind == DEVICE_GPU and d.usable_bytes > reserve and d.name != HOST_DEVICE
    ]
    return tuple(sorted(gpus, key=lambda g: (-g.room, g.name)))


def _gpu_units(c: Candidate, required: int, reserve: int) -> int:
    """What all of the candidate's GPUs could take of ``required``, in split units."""
    return sum(_cap(g.room, required) for g in _gpus(c, reserve))


def _pick_gpus(nodes: Sequence[Candidate], required: int, reserve: int) -> tuple[_Gpu, ...] | None:
    """The fewest, roomiest GPUs of ``nodes`` that hold ``required`` together, or None."""
    order = {c.node_id: i for i, c in enumerate(nodes)}
    gpus = sorted(
        (g for c in nodes for g in _gpus(c, reserve)),
        key=lambda g: (-_cap(g.room, required), -g.room, order[g.node_id], g.name),
    )
    picked: list[_Gpu] = []
    units = 0
    for g in gpus:
        picked.append(g)
        units += _cap(g.room, required)
        if units >= RES:
            return tuple(picked)
    return None


def _host_gpu_layers(c: Candidate, required: int, layers: int, reserve: int) -> int:
    """Most layers (>= 1) the candidate's GPUs take while its host memory holds the rest, or 0:
    no such split (no GPU with room for a layer, or too little host memory)."""
    rooms = [g.room for g in _gpus(c, reserve)]
    if not rooms:
        return 0

    def gpu_bytes(g: int) -> int:
        return -(-required * g // layers)

    lo, hi = 0, layers  # the GPUs hold gpu_bytes(lo) (lo == 0: nothing), not gpu_bytes(hi + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(rooms, gpu_bytes(mid)):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0 or c.usable_memory_bytes < required - gpu_bytes(lo):
        return 0
    return lo


# ---------------------------------------------------------------------------------------------
# tiers: what a set of nodes can do, and how its plan is laid out


@dataclass(frozen=True, slots=True)
class _Tier:
    name: str
    #: Node counts this tier plans with.
    multi: bool
    single: bool
    #: How well a candidate serves the tier (workers and primaries roomiest first).
    weight: Callable[[Candidate, int, int], int]
    #: Whether ``nodes`` (primary first) hold ``required`` in this tier: a cost to minimise
    #: among plans of as many nodes, or None.
    fit: Callable[[Sequence[Candidate], int, PlacementRequest], tuple[int, ...] | None]
    #: Only candidates with GPUs take part (as workers; a primary may have none in
    #: ``gpus_over_rpc``).
    gpus_only: bool


def _host_weight(c: Candidate, _required: int, _reserve: int) -> int:
    return c.usable_memory_bytes


def _fit_one_device(
    nodes: Sequence[Candidate], required: int, request: PlacementRequest
) -> tuple[int, ...] | None:
    picked = _pick_gpus(nodes, required, request.device_reserve_bytes)
    return (1,) if picked is not None and len(picked) == 1 else None


def _fit_gpus(
    nodes: Sequence[Candidate], required: int, request: PlacementRequest
) -> tuple[int, ...] | None:
    picked = _pick_gpus(nodes, required, request.device_reserve_bytes)
    if picked is None:
        return None
    # Every worker takes a share (else fewer nodes would do; see the module docstring).
    if any(not any(g.node_id == w.node_id for g in picked) for w in nodes[1:]):
        return None
    return (len(picked),)


def _fit_gpus_and_host(
    nodes: Sequence[Candidate], required: int, request: PlacementRequest
) -> tuple[int, ...] | None:
    layers = request.needs.layers
    g = _host_gpu_layers(nodes[0], required, layers, request.device_reserve_bytes)
    return (layers - g,) if g else None


def _fit_host(
    nodes: Sequence[Candidate], required: int, _request: PlacementRequest
) -> tuple[int, ...] | None:
    return () if _fits((c.usable_memory_bytes for c in nodes), required) else None


_TIERS = (
    _Tier(TIER_ONE_DEVICE, False, True, _gpu_units, _fit_one_device, True),
    _Tier(TIER_ONE_NODE_GPUS, False, True, _gpu_units, _fit_gpus, True),
    _Tier(TIER_GPUS_AND_HOST, False, True, _gpu_units, _fit_gpus_and_host, True),
    _Tier(TIER_CPU, False, True, _host_weight, _fit_host, False),
    _Tier(TIER_GPUS_OVER_RPC, True, False, _gpu_units, _fit_gpus, True),
    _Tier(TIER_CPU_OVER_RPC, True, False, _host_weight, _fit_host, False),
)
assert tuple(t.name for t in _TIERS) == TIERS


# ---------------------------------------------------------------------------------------------
# choosing nodes


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


def _too_slow(primary: Candidate, worker: Candidate, min_mbps: float) -> bool:
    """The link between them was measured slower than ``min_mbps`` (0: no floor)."""
    link = link_between(primary, worker)
    return min_mbps > 0 and link is not None and link.mbps < min_mbps


def _link_rank(primary: Candidate, worker: Candidate) -> tuple[int, float, float]:
    """Measured links first, the fastest (then the nearest) first; unmeasured ones last."""
    link = link_between(primary, worker)
    return (1, 0.0, 0.0) if link is None else (0, -link.mbps, link.rtt_ms)


def _link_order(
    primary: Candidate, rank: Callable[[Candidate], tuple[int, str]], worker: Candidate
) -> tuple[tuple[int, float, float], tuple[int, str]]:
    """Workers by their link to ``primary`` (:func:`_link_rank`), then by ``rank``."""
    return _link_rank(primary, worker), rank(worker)


def _links_cost(primary: Candidate, workers: Sequence[Candidate]) -> float:
    """Minus the slowest link's Mbit/s between the primary and its workers (an unmeasured
    link counts as 0): a plan whose slowest link is faster ranks first."""
    slowest = min(
        ((link.mbps if (link := link_between(primary, w)) else 0.0) for w in workers),
        default=0.0,
    )
    return -slowest


@dataclass(frozen=True, slots=True)
class _Choice:
    key: tuple[int, int, tuple[int, ...], float, int, int, str]
    tier: _Tier
    primary: Candidate
    workers: tuple[Candidate, ...]

    @property
    def nodes(self) -> tuple[Candidate, ...]:
        return (self.primary, *self.workers)


def _best_in_tier(
    tier: _Tier, pool: Sequence[Candidate], request: PlacementRequest, limit: int
) -> _Choice | None:
    """Fewest nodes, then fewest DEGRADED, fewest warm servers displaced, least cost, READY
    primary, roomiest primary, smallest id."""
    required = request.required_bytes
    reserve = request.device_reserve_bytes
    weights = {c.node_id: tier.weight(c, required, reserve) for c in pool}

    def rank(c: Candidate) -> tuple[int, str]:
        return (-weights[c.node_id], c.node_id)

    primaries = sorted((c for c in pool if c.has_model), key=rank)
    workers_pool: list[Candidate] | None = None  # sorted only once one node is not enough
    first = 1 if tier.single else 2
    last = min(limit, len(pool)) if tier.multi else 1
    for k in range(first, last + 1):
        best: _Choice | None = None
        for p in primaries:
            p_degraded = int(p.state != NodeState.READY)
            if k == 1:
                cost = tier.fit((p,), required, request)
                if cost is not None:
                    key = (
                        p_degraded,
                        int(p.warm),
                        cost,
                        0.0,
                        p_degraded,
                        -weights[p.node_id],
                        p.node_id,
                    )
                    if best is None or key < best.key:
                        best = _Choice(key, tier, p, ())
                continue
            if workers_pool is None:
                workers_pool = sorted(
                    (c for c in pool if not tier.gpus_only or weights[c.node_id] > 0), key=rank
                )
            others = [
                c
                for c in workers_pool
                if c.node_id != p.node_id
                and c.rpc_protocol == p.rpc_protocol
                and not _too_slow(p, c, request.min_link_mbps)
            ]
            # Fastest links first; the roomiest first when those do not hold the model.
            fastest = sorted(others, key=functools.partial(_link_order, p, rank))
            for d in range(0, k):
                workers_found = None
                for order in (fastest, others):
                    ready = [c for c in order if c.state == NodeState.READY]
                    degraded = [c for c in order if c.state != NodeState.READY]
                    if k - 1 - d > len(ready) or d > len(degraded):
                        break
                    workers = sorted([*ready[: k - 1 - d], *degraded[:d]], key=rank)
                    cost = tier.fit((p, *workers), required, request)
                    if cost is not None:
                        workers_found = (workers, cost)
                        break
                if workers_found is None:
                    continue
                workers, cost = workers_found
                warm = int(p.warm) + sum(int(w.warm) for w in workers)
                key = (
                    d + p_degraded,
                    warm,
                    cost,
                    _links_cost(p, workers),
                    p_degraded,
                    -weights[p.node_id],
                    p.node_id,
                )
                if best is None or key < best.key:
                    best = _Choice(key, tier, p, tuple(workers))
                break  # more DEGRADED workers for this primary can only rank lower
        if best is not None:
            return best
    return None


def _best(pool: Sequence[Candidate], request: PlacementRequest, limit: int) -> _Choice | None:
    with_gpus = any(_gpus(c, request.device_reserve_bytes) for c in pool)
    for tier in _TIERS:
        if tier.gpus_only and not with_gpus:
            continue
        choice = _best_in_tier(tier, pool, request, limit)
        if choice is not None:
            return choice
    return None


# ---------------------------------------------------------------------------------------------
# laying the plan out


def _required(request: PlacementRequest, parallel: int) -> int:
    return required_bytes(
        request.needs,
        request.context_size * parallel,
        request.headroom_fraction,
        request.overhead_bytes,
    )


def _most_slots(request: PlacementRequest, choice: _Choice) -> tuple[int, int]:
    """(parallel, required bytes): the most slots up to the primary's cap that still fit the
    chosen nodes in the chosen tier."""
    for parallel in range(min(max(1, choice.primary.slot_cap), MAX_SLOTS), 1, -1):
        required = _required(request, parallel)
        if choice.tier.fit(choice.nodes, required, request) is not None:
            return parallel, required
    return 1, request.required_bytes


def _fmt(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.0f} MiB"


def _pct(units: int) -> str:
    return f"{units * 100 / RES:.1f} %"


@dataclass(frozen=True, slots=True)
class _Layout:
    devices: tuple[PlanDevice, ...]
    node_units: dict[str, int]
    node_bytes: dict[str, int]
    n_gpu_layers: int | None
    lines: tuple[str, ...]


def _gpu_layout(
    choice: _Choice, required: int, request: PlacementRequest, labels: dict[str, str]
) -> _Layout:
    reserve = request.device_reserve_bytes
    layers = request.needs.layers
    primary = choice.primary
    n_gpu_layers: int | None = None
    if choice.tier.name == TIER_GPUS_AND_HOST:
        on_gpus = _host_gpu_layers(primary, required, layers, reserve)
        gpu_bytes = -(-required * on_gpus // layers)
        picked = _gpus(primary, reserve)
        n_gpu_layers = on_gpus
    else:
        found = _pick_gpus(choice.nodes, required, reserve)
        assert found is not None  # the tier's fit said so
        picked, gpu_bytes = found, required
    order = {c.node_id: i for i, c in enumerate(choice.nodes)}
    picked = tuple(sorted(picked, key=lambda g: (order[g.node_id], g.name)))
    units = split_units([g.room for g in picked], gpu_bytes)
    devices = []
    node_units: dict[str, int] = {c.node_id: 0 for c in choice.nodes}
    node_bytes: dict[str, int] = {c.node_id: 0 for c in choice.nodes}
    for g, u in zip(picked, units, strict=True):
        assigned = _share_bytes(u, gpu_bytes) + reserve
        devices.append(
            PlanDevice(g.node_id, g.name, u / RES, assigned, via_rpc=g.node_id != primary.node_id)
        )
        node_units[g.node_id] += u
        node_bytes[g.node_id] += assigned
    shares = ", ".join(
        f"{g.name} on {labels[g.node_id]} {_pct(u)} ({_fmt(_share_bytes(u, gpu_bytes))} of "
        f"{_fmt(g.room)} room)"
        for g, u in zip(picked, units, strict=True)
    )
    name = choice.tier.name
    lines = []
    if name == TIER_ONE_DEVICE:
        lines.append(f"{name}: one GPU holds it: {shares}")
    elif name == TIER_ONE_NODE_GPUS:
        lines.append(f"{name}: no single GPU holds it; {len(picked)} GPUs of one node do: {shares}")
    elif name == TIER_GPUS_OVER_RPC:
        lines.append(
            f"{name}: no node with the model file holds it alone (in its GPUs, its GPUs and "
            f"host memory, or its host memory); {len(picked)} GPUs of {len(choice.nodes)} nodes "
            f"do, the workers' over RPC: {shares}"
        )
    else:
        host = required - gpu_bytes
        node_bytes[primary.node_id] += host
        lines.append(
            f"{name}: no node's GPUs hold it alone; {labels[primary.node_id]}'s GPUs take the last "
            f"{n_gpu_layers} of {layers} layers ({shares}) and its host memory the other "
            f"{layers - (n_gpu_layers or 0)} ({_fmt(host)} of {_fmt(primary.usable_memory_bytes)})"
        )
    lines.append(f"each GPU keeps {_fmt(reserve)} beyond its share for compute buffers")
    return _Layout(tuple(devices), node_units, node_bytes, n_gpu_layers, tuple(lines))


def _host_layout(
    choice: _Choice, required: int, request: PlacementRequest, labels: dict[str, str]
) -> _Layout:
    nodes = choice.nodes
    units = split_units([c.usable_memory_bytes for c in nodes], required)
    node_units = {c.node_id: u for c, u in zip(nodes, units, strict=True)}
    node_bytes = {c.node_id: _share_bytes(u, required) for c, u in zip(nodes, units, strict=True)}
    gpus = any(_gpus(c, request.device_reserve_bytes) for c in nodes)
    if len(nodes) == 1:
        # One node's host memory: no --device list; its GPUs (if any) take no layers.
        only = nodes[0]
        has_gpu = any(d.kind == DEVICE_GPU for d in only.devices)
        why = (
            "no node's GPUs hold it, alone or with its host memory" if gpus else "no GPU takes part"
        )
        return _Layout(
            (),
            node_units,
            node_bytes,
            0 if has_gpu else None,
            (
                f"{TIER_CPU}: {why}; {labels[only.node_id]}'s host memory holds it "
                f"({_fmt(required)} of {_fmt(only.usable_memory_bytes)})",
            ),
        )
    devices = tuple(
        PlanDevice(c.node_id, HOST_DEVICE, node_units[c.node_id] / RES, node_bytes[c.node_id], True)
        for c in nodes
    )
    shares = ", ".join(
        f"{labels[c.node_id]} {_pct(node_units[c.node_id])} ({_fmt(node_bytes[c.node_id])} of "
        f"{_fmt(c.usable_memory_bytes)})"
        for c in nodes
    )
    return _Layout(
        devices,
        node_units,
        node_bytes,
        None,
        (
            f"{TIER_CPU_OVER_RPC}: no node with the model file holds it alone and "
            f"{'no GPU plan does' if gpus else 'no GPU takes part'}; the host memory of "
            f"{len(nodes)} nodes, each through its RPC worker: {shares}",
        ),
    )


def _build_plan(request: PlacementRequest, choice: _Choice) -> ExecutionPlan:
    parallel, required = _most_slots(request, choice)
    labels = {c.node_id: c.name or c.node_id for c in choice.nodes}
    if choice.tier.name in (TIER_CPU, TIER_CPU_OVER_RPC):
        layout = _host_layout(choice, required, request, labels)
    else:
        layout = _gpu_layout(choice, required, request, labels)
    # Nodes that take no share (a GPU-less primary of a gpus_over_rpc plan) stay in the plan.
    nodes = [
        PlanNode(
            node_id=c.node_id,
            address=c.address,
            rpc_port=c.rpc_port,
            assigned_bytes=layout.node_bytes[c.node_id],
        )
        for c in choice.nodes
    ]
    needs = request.needs
    slots = (
        f"{parallel} slot(s) of {request.context_size} tokens (the primary offers "
        f"{choice.primary.slot_cap}); the model needs {_fmt(required)} with their KV cache"
    )
    return ExecutionPlan(
        model_name=needs.name,
        model_sha256=needs.sha256,
        model_file_name=needs.file_name,
        context_size=request.context_size,
        required_bytes=required,
        primary=nodes[0],
        workers=tuple(nodes[1:]),
        tensor_split=tuple(layout.node_units[c.node_id] / RES for c in choice.nodes),
        parallel=parallel,
        devices=layout.devices,
        n_gpu_layers=layout.n_gpu_layers,
        tier=choice.tier.name,
        reasons=(*layout.lines, slots),
    )


# ---------------------------------------------------------------------------------------------
# refusals


def _host_capacity(pool: Sequence[Candidate], limit: int) -> int:
    """Most host memory a plan of at most ``limit`` nodes with a file-holding primary gathers."""
    ranked = sorted(pool, key=lambda c: (-c.usable_memory_bytes, c.node_id))
    best = 0
    for p in ranked:
        if not p.has_model:
            continue
        others = [c.usable_memory_bytes for c in ranked if c.node_id != p.node_id]
        best = max(best, p.usable_memory_bytes + sum(others[: limit - 1]))
    return best


def _gpu_note(pool: Sequence[Candidate], reserve: int) -> str:
    gpus = [g for c in pool for g in _gpus(c, reserve)]
    if not gpus:
        return ""
    room = sum(g.room for g in gpus)
    return (
        f"; their {len(gpus)} GPU(s) have {_fmt(room)} of room for layers in all, after "
        f"{_fmt(reserve)} of compute buffers each"
    )


def _no_capacity(
    request: PlacementRequest, pool: Sequence[Candidate], limit: int, considered: int
) -> NoCapacity:
    needs = request.needs
    required = request.required_bytes
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
    protocols = sorted({c.rpc_protocol for c in pool})
    if len(protocols) > 1:
        one = [dataclasses.replace(c, rpc_protocol="") for c in pool]
        if _best(one, request, limit) is not None:
            spoken = "; ".join(
                f"{p or 'unknown'} on "
                + ", ".join(sorted(c.name or c.node_id for c in pool if c.rpc_protocol == p))
                for p in protocols
            )
            return NoCapacity(
                reason=(
                    f"{model} needs {_fmt(required)}, which only nodes speaking different "
                    f"llama.cpp RPC protocols could hold together ({spoken}); a split never "
                    "mixes them: run one llama.cpp version on those nodes"
                ),
                code=RPC_VERSION_MISMATCH,
                needed_bytes=required,
                available_bytes=_host_capacity(pool, limit),
            )
    if request.min_link_mbps > 0:
        unbounded = _best(pool, dataclasses.replace(request, min_link_mbps=0.0), limit)
        if unbounded is not None:
            slow = [
                f"{_label(unbounded.primary)} to {_label(w)} ({link.mbps:.0f} Mbit/s, "
                f"{link.rtt_ms:.1f} ms)"
                for w in unbounded.workers
                if (link := link_between(unbounded.primary, w)) is not None
                and link.mbps < request.min_link_mbps
            ]
            return NoCapacity(
                reason=(
                    f"{model} needs {_fmt(required)}, which only a split over a link slower "
                    f"than MIN_SPLIT_LINK_MBPS={request.min_link_mbps:g} could hold: "
                    f"{'; '.join(slow)}; a split decodes over that link token by token"
                ),
                code=SLOW_LINK,
                needed_bytes=required,
                available_bytes=_host_capacity(pool, limit),
            )
    available = _host_capacity(pool, limit)
    total = sum(c.usable_memory_bytes for c in pool)
    context = f"with context {request.context_size}"
    gpus = _gpu_note(pool, request.device_reserve_bytes)
    if _fits((c.usable_memory_bytes for c in pool), required) and len(pool) > limit:
        return NoCapacity(
            reason=(
                f"{model} {context} needs {_fmt_exact(required)}; the {len(pool)} eligible "
                f"nodes have {_fmt_exact(total)} together, but a plan may use at most {limit} "
                f"node(s) (max_nodes {request.max_nodes}, model layers {needs.layers}), which "
                f"gather at most {_fmt_exact(available)}{gpus}"
            ),
            code=NODE_LIMIT,
            needed_bytes=required,
            available_bytes=available,
        )
    if available >= required:
        return NoCapacity(
            reason=(
                f"{model} {context} needs {_fmt_exact(required)}; the best plan over up to "
                f"{min(limit, len(pool))} of the {len(pool)} eligible node(s) gathers "
                f"{_fmt_exact(available)}, which leaves no room for rounding the tensor split "
                f"to 1/{RES} without exceeding a node's usable memory{gpus}"
            ),
            code=INSUFFICIENT_MEMORY,
            needed_bytes=required,
            available_bytes=available,
        )
    return NoCapacity(
        reason=(
            f"{model} {context} needs {_fmt_exact(required)} but the best plan over up to "
            f"{min(limit, len(pool))} of the {len(pool)} eligible node(s) gathers only "
            f"{_fmt_exact(available)} of host memory{gpus}"
        ),
        code=INSUFFICIENT_MEMORY,
        needed_bytes=required,
        available_bytes=available,
    )


def _label(c: Candidate) -> str:
    return c.name or c.node_id


def _fmt_exact(n: int) -> str:
    return f"{n / GIB:.2f} GiB ({n} bytes)"


# ---------------------------------------------------------------------------------------------
# the planner


def plan_placement(request: PlacementRequest, candidates: Iterable[Candidate]) -> PlacementResult:
    """Choose primary, devices, workers and shares for ``request`` (see the module docstring).

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

    limit = min(request.max_nodes, request.needs.layers)
    ready_pool = [c for c in pool if c.state == NodeState.READY]

    fallback_used = False
    choice = _best(ready_pool, request, limit)
    if choice is None and len(ready_pool) < len(pool):
        choice = _best(pool, request, limit)
        fallback_used = choice is not None

    if choice is None:
        return PlacementResult(
            plan=None,
            no_capacity=_no_capacity(request, pool, limit, len(ordered)),
            violations=tuple(violations),
        )
    plan = _build_plan(request, choice)
    if fallback_used:
        plan = dataclasses.replace(
            plan, reasons=(*plan.reasons, "no plan of READY nodes alone; DEGRADED nodes joined")
        )
    return PlacementResult(plan=plan, violations=tuple(violations), fallback_used=fallback_used)
