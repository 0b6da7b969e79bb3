"""Warm runtimes: llama-servers already running a model, and which of them can take a job.

A primary's ``llama-server`` runs with ``--parallel S``: S slots, each with the model's
context, serving S jobs at once over the same RPC workers. Every node that takes part in such a
server (its primary and its RPC workers) records the server's *runtime* with each job it is
assigned: ``{"key": plan.runtime_key, "plan": plan.to_dict()}``. A node serves one runtime at a
time; it counts its jobs against that runtime's ``parallel``, not against a slot per job per
node, and keeps the runtime after its last job ends, because the server stays warm.

:func:`warm_choice` is the scheduler's first resort: the warm server for the model with a free
slot, whose primary and workers are all still usable and still serve that same runtime. Only
when there is none does the split planner (:mod:`domain.placement`) start a cold one. Pure: no
clock, no I/O; the result does not depend on the order of the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from domain.placement import ExecutionPlan
from domain.states import NodeState

_READY = NodeState.READY.value
_DEGRADED = NodeState.DEGRADED.value
_BUSY = NodeState.BUSY.value


def runtime_of(plan: ExecutionPlan) -> dict[str, Any]:
    """What each node of ``plan`` records about the server the plan runs on."""
    return {"key": plan.runtime_key, "plan": plan.to_dict()}


def runtime_key(runtime: Mapping[str, Any] | None) -> str:
    return str(runtime["key"]) if runtime else ""


def runtime_capacity(runtime: Mapping[str, Any] | None, slots: int) -> int:
    """Jobs a node can hold: its runtime's slots, or its own slot cap with no runtime yet."""
    if not runtime:
        return slots
    return int(runtime["plan"].get("parallel", 1))


def server_name(primary_node_id: str, key: str) -> str:
    """A server's name: its primary and its runtime's key (another runtime on the same node
    is another server, with another cache)."""
    return f"{primary_node_id}/{key}"


def server_of(plan: ExecutionPlan) -> str:
    """The name of the server ``plan`` runs on (:func:`server_name`)."""
    return server_name(plan.primary.node_id, plan.runtime_key)


@dataclass(frozen=True, slots=True)
class WarmChoice:
    plan: ExecutionPlan
    free_slots: int
    degraded: bool

    @property
    def server(self) -> str:
        """The server's name (:func:`server_of`)."""
        return server_of(self.plan)

    @property
    def running(self) -> int:
        """The jobs the server runs now."""
        return self.plan.parallel - self.free_slots

    @property
    def rank(self) -> tuple[int, int, str]:
        """READY servers first, then the most free slots (spreading load), then the smallest
        primary id."""
        return (int(self.degraded), -self.free_slots, self.plan.primary.node_id)


def _usable(row: Mapping[str, Any], key: str, busy: bool = False) -> bool:
    """Whether ``row``'s node can serve one more job on the runtime ``key`` (``busy``: or
    could once one of its jobs ends)."""
    states = (_READY, _DEGRADED, _BUSY) if busy else (_READY, _DEGRADED)
    if row["drain_requested"] or row["state"] not in states:
        return False
    runtime = row.get("runtime")
    return runtime_key(runtime) == key


def warm_choices(
    rows: Mapping[str, Mapping[str, Any]],
    *,
    model_name: str,
    model_sha256: str,
    context_size: int,
    exclude: frozenset[str] = frozenset(),
    reachable: Callable[[str], bool] = lambda _node_id: True,
    primary_holds: Callable[[str], bool] = lambda _node_id: True,
    busy: bool = False,
) -> list[WarmChoice]:
    """Every warm server that could take a job for the model (``busy``: and those that
    could once a slot frees, with ``free_slots`` 0). A server runs one
    registered model: another name for the same file (an embedding model, say) is another
    server.

    ``rows`` are node read-model rows by node id (with this controller's own assignments
    applied); ``reachable`` says whether a node's heartbeat is fresh and its agent is connected
    here; ``primary_holds`` whether a primary still holds the model's file as proven (a
    server whose primary's claim was refused since is not reused). In the order of
    :attr:`WarmChoice.rank`.
    """
    found: list[WarmChoice] = []
    for node_id, row in rows.items():
        runtime = row.get("runtime")
        if not runtime:
            continue
        spec = runtime["plan"]
        if (
            spec["primary"]["node_id"] != node_id
            or spec.get("model_name") != model_name
            or spec["model_sha256"] != model_sha256
            or int(spec["context_size"]) != context_size
            or not primary_holds(node_id)
        ):
            continue
        free = int(spec.get("parallel", 1)) - len(row["current_jobs"])
        if free <= 0 and not busy:
            continue
        free = max(free, 0)
        plan = ExecutionPlan.from_dict(spec)
        key = runtime_key(runtime)
        members = [rows.get(n) for n in plan.node_ids]
        if any(
            member is None
            or member_id in exclude
            or not reachable(member_id)
            or not _usable(member, key, busy)
            for member_id, member in zip(plan.node_ids, members, strict=True)
        ):
            continue
        degraded = any(m is not None and m["state"] == _DEGRADED for m in members)
        found.append(WarmChoice(plan, free, degraded))
    return sorted(found, key=lambda choice: choice.rank)


def warm_choice(
    rows: Mapping[str, Mapping[str, Any]],
    *,
    model_name: str,
    model_sha256: str,
    context_size: int,
    exclude: frozenset[str] = frozenset(),
    reachable: Callable[[str], bool] = lambda _node_id: True,
    primary_holds: Callable[[str], bool] = lambda _node_id: True,
) -> WarmChoice | None:
    """The warm server that should take a job for the model, or None: the first of
    :func:`warm_choices` (READY first, then the most free slots, then the smallest primary id).
    """
    choices = warm_choices(
        rows,
        model_name=model_name,
        model_sha256=model_sha256,
        context_size=context_size,
        exclude=exclude,
        reachable=reachable,
        primary_holds=primary_holds,
    )
    return choices[0] if choices else None
