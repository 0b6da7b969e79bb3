"""Placement requests and candidate nodes for the planner's tests (domain/split_planner.py),
built with only what a test is about spelled out."""

from __future__ import annotations

from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.placement import (
    DEFAULT_DEVICE_RESERVE_BYTES,
    Candidate,
    Device,
    ModelNeeds,
    PlacementRequest,
)


def exact_request(
    needs: ModelNeeds,
    *,
    context_size: int,
    max_nodes: int = 8,
    exclude: frozenset[str] = frozenset(),
    cidrs: tuple[str, ...] = DEFAULT_ALLOWED_PEER_CIDRS,
    reserve: int = DEFAULT_DEVICE_RESERVE_BYTES,
) -> PlacementRequest:
    """A request for ``needs`` whose required bytes are exactly its weights when it has no KV
    cache (no headroom, no overhead); ``reserve`` stays on each GPU beyond its share."""
    return PlacementRequest(
        needs,
        context_size,
        cidrs,  # allowed_peer_cidrs
        max_nodes=max_nodes,
        exclude=exclude,
        headroom_fraction=0.0,
        overhead_bytes=0,
        device_reserve_bytes=reserve,
    )


def weights_only(name: str, sha256: str, file_name: str, weights: int, layers: int) -> ModelNeeds:
    """A model of ``weights`` bytes in ``layers`` layers with no KV cache (8,192 tokens at most)."""
    return ModelNeeds(
        name, sha256, file_name, weights, layers, kv_bytes_per_token=0, context_length_max=8192
    )


def candidate(
    node_id: str,
    memory: int,
    *,
    state: str = "READY",
    has_model: bool = False,
    address: str | None = None,
    free_slots: int = 1,
    fresh: bool = True,
    rpc_port: int = 50052,
    slot_cap: int = 1,
    devices: tuple[Device, ...] = (),
    rpc_protocol: str = "",
) -> Candidate:
    """Node ``node_id`` (``host-<id>``, at an address derived from the id unless given) with
    ``memory`` usable bytes."""
    return Candidate(
        node_id=node_id,
        name=f"host-{node_id}",
        state=state,
        address=address if address is not None else f"10.0.0.{sum(map(ord, node_id)) % 250 + 1}",
        rpc_port=rpc_port,
        usable_memory_bytes=memory,
        free_slots=free_slots,
        has_model=has_model,
        heartbeat_fresh=fresh,
        slot_cap=slot_cap,
        devices=devices,
        rpc_protocol=rpc_protocol,
    )
