"""The scheduler: read model + live telemetry in, an execution plan (or no capacity) out.

A job goes to a warm server first (:func:`domain.runtimes.warm_choice`: a llama-server already
running the model with a free slot); only when none can take it does the split planner
(:func:`domain.split_planner.plan_placement`) start a cold one on idle nodes. Both are pure
functions; this module only gathers what they need at one instant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from application.device_budgets import DeviceBudgets
from application.ports import LiveNode, LiveState, ReadModel
from application.prefix_routing import PrefixRouter
from application.read_models import eligibility_of, model_facts, proves
from application.slot_ledger import SlotLedger
from domain.placement import (
    DEVICE_GPU,
    HOST_DEVICE,
    MAX_NODE_MEMORY_BYTES,
    MAX_SLOTS,
    MODEL_NOT_PRESENT,
    WAITS_FOR_CACHE,
    Candidate,
    Device,
    ExecutionPlan,
    Link,
    ModelNeeds,
    NoCapacity,
    PlacementRequest,
    PlacementResult,
)
from domain.prefix_index import server_cache_blocks
from domain.runtimes import WarmChoice, server_of, warm_choices
from domain.split_planner import plan_placement
from domain.states import NodeState


@dataclass(frozen=True)
class SchedulerConfig:
    allowed_peer_cidrs: tuple[str, ...]
    max_nodes: int = 8
    #: No split over a link measured slower than this, in Mbit/s (MIN_SPLIT_LINK_MBPS; 0: any).
    min_link_mbps: float = 0.0


def _reports_devices(node: dict[str, Any]) -> bool:
    """The node lists its devices as llama.cpp sees them: its GPUs are planned one by one and
    its host memory is its RAM (an agent from before devices: one figure, GPUs' or RAM)."""
    return bool((node.get("resources") or {}).get("devices"))


def _live_free_bytes(live: LiveNode | None, per_device: bool = False) -> int | None:
    if live is None or not live.telemetry:
        return None
    gpus = [] if per_device else live.telemetry.get("gpus") or []
    gpu_free = sum(int(g.get("memory_free_bytes", 0)) for g in gpus)
    if gpu_free > 0:
        return gpu_free
    ram = live.telemetry.get("ram_free_bytes")
    return int(ram) if ram else None


def _total_memory_bytes(node: dict[str, Any]) -> int | None:
    """The memory the node says it has in all (its GPUs', else its RAM), if it says; its RAM
    alone when it lists its devices (the GPUs are then counted one by one)."""
    resources = node.get("resources") or {}
    gpus = [g for g in resources.get("gpus") or [] if isinstance(g, dict)]
    if _reports_devices(node):
        gpus = []
    gpu_total = sum(int(g.get("memory_total_bytes") or 0) for g in gpus)
    if gpu_total > 0:
        return gpu_total
    ram = resources.get("ram_total_bytes")
    return int(ram) if ram else None


def usable_memory(eligible: dict[str, Any], node: dict[str, Any], live: LiveNode | None) -> int:
    """min(read-model free memory, live free memory), capped by the node's offered limit.

    The node's own figures (it runs the work), kept sane: free memory never counts for
    more than the node's total, nor beyond MAX_NODE_MEMORY_BYTES."""
    per_device = _reports_devices(node)
    usable = int(eligible["free_memory_bytes"])
    live_free = _live_free_bytes(live, per_device)
    if live_free is not None:
        usable = min(usable, live_free)
    limit = int((node.get("inventory") or {}).get("memory_limit_bytes") or 0)
    if limit > 0:
        usable = min(usable, limit)
    total = _total_memory_bytes(node)
    if total is not None:
        usable = min(usable, total)
    return max(0, min(usable, MAX_NODE_MEMORY_BYTES))


def node_devices(
    node: dict[str, Any],
    live: LiveNode | None,
    budgets: DeviceBudgets | None = None,
) -> tuple[Device, ...]:
    """The node's GPUs as the planner sees them: free memory as last reported (the heartbeat's
    figure when fresher and lower), within the node's --memory-limit and any budget lowered
    after an out-of-memory. The host CPU is not among them (see :func:`usable_memory`)."""
    resources = node.get("resources") or {}
    listed = [d for d in resources.get("devices") or [] if isinstance(d, dict)]
    if not listed:
        return ()
    live_free: dict[str, int] = {}
    if live is not None and live.telemetry:
        for entry in live.telemetry.get("devices") or []:
            if isinstance(entry, dict) and entry.get("name"):
                live_free[str(entry["name"])] = int(entry.get("memory_free_bytes") or 0)
    limit = int((node.get("inventory") or {}).get("memory_limit_bytes") or 0)
    devices = []
    for entry in listed:
        if entry.get("kind") != DEVICE_GPU:
            continue
        name = str(entry.get("name") or "")
        if not name or name == HOST_DEVICE:
            continue
        usable = min(
            int(entry.get("memory_free_bytes") or 0), int(entry.get("memory_total_bytes") or 0)
        )
        if name in live_free:
            usable = min(usable, live_free[name])
        if limit > 0:
            usable = min(usable, limit)
        if budgets is not None:
            cap = budgets.cap(node["node_id"], name)
            if cap is not None:
                usable = min(usable, cap)
        devices.append(
            Device(
                name=name,
                usable_bytes=max(0, min(usable, MAX_NODE_MEMORY_BYTES)),
                description=str(entry.get("description") or ""),
            )
        )
    return tuple(devices)


def model_needs(model: dict[str, Any], nodes: dict[str, dict[str, Any]]) -> ModelNeeds | None:
    """The model's size and shape: its registered facts (the controller's model store, or
    the first node that proved it holds the file, unless revoked since), never what a node
    reports (see domain/model_claims.py). ``nodes`` are node rows by id."""
    facts = model_facts(model, nodes)
    return _needs(model, facts[0]) if facts is not None else None


def _needs(model: dict[str, Any], shape: dict[str, Any]) -> ModelNeeds:
    return ModelNeeds(
        name=model["name"],
        sha256=model["sha256"],
        file_name=model["file_name"],
        weights_bytes=int(shape["size_bytes"]),
        layers=max(1, int(shape.get("layers") or 1)),
        kv_bytes_per_token=int(shape.get("kv_bytes_per_token") or 0),
        context_length_max=int(shape.get("context_length") or model["context_size"]),
    )


def _cache_blocks(needs: ModelNeeds, plan: ExecutionPlan) -> int:
    """The prefix blocks the server of ``plan`` holds at most, its slots and its prompt cache."""
    return server_cache_blocks(needs.kv_bytes_per_token, plan.context_size, plan.parallel)


def links_of(row: dict[str, Any]) -> dict[str, Link]:
    """The node's links to its peers as it last measured them (NODE_LINKS_MEASURED); a link
    it could not measure is not one."""
    found = {}
    for peer, link in (row.get("links") or {}).items():
        if isinstance(link, dict) and not link.get("error") and float(link.get("mbps") or 0) > 0:
            found[str(peer)] = Link(float(link["mbps"]), float(link.get("rtt_ms") or 0.0))
    return found


def idle_eligibility(node: dict[str, Any]) -> dict[str, Any] | None:
    """The eligibility row ``node`` would have with none of its slots taken."""
    if node["state"] == NodeState.BUSY:
        node = {**node, "state": NodeState.READY}
    return eligibility_of({**node, "current_jobs": []})


class Scheduler:
    def __init__(
        self,
        read_model: ReadModel,
        live: LiveState,
        config: SchedulerConfig,
        catch_up: Callable[[], None] = lambda: None,
        ledger: SlotLedger | None = None,
        budgets: DeviceBudgets | None = None,
        router: PrefixRouter | None = None,
    ) -> None:
        #: Device budgets lowered after an out-of-memory (application/device_budgets.py).
        self.budgets = budgets if budgets is not None else DeviceBudgets()
        #: What each warm server's cache holds, and the choice by prompt prefix.
        self.router = router if router is not None else PrefixRouter()
        self.read_model = read_model
        self.live = live
        self.config = config
        #: Waits until the read model has every event stored so far (slow under load: only
        #: after a placement lost a slot to a write the ledger cannot know about).
        self.catch_up = catch_up
        self.ledger = ledger if ledger is not None else SlotLedger()
        # node → ((row, live entry, model sha256 and basis), its candidate): see _candidate.
        self._candidates: dict[str, tuple[Any, LiveNode | None, str, Candidate | None]] = {}

    def release(self, job_id: str) -> None:
        """Job ``job_id`` ended, or its placement was undone: its slots are free again."""
        self.ledger.released(job_id)

    def _candidate(
        self,
        row: dict[str, Any],
        live: LiveNode | None,
        sha256: str,
        basis: str,
        assume_idle: bool,
        pretend_holding: frozenset[str] = frozenset(),
    ) -> Candidate | None:
        """The node as a cold plan sees it (heartbeat assumed fresh), or None: ineligible.
        It holds the model only once it proved so against the model's facts (``basis``).

        Rows and live entries are replaced, never changed, so the candidate built for the same
        row, live entry and model before is still right: most placements build none.
        """
        fresh = assume_idle or bool(pretend_holding)
        seen = None if fresh else self._candidates.get(row["node_id"])
        model_key = f"{sha256}:{basis}:{self.budgets.version}"
        if seen is not None and seen[0] is row and seen[1] is live and seen[2] == model_key:
            return seen[3]
        eligible = (idle_eligibility if assume_idle else eligibility_of)(row)
        candidate = None
        if eligible is not None:
            usable = usable_memory(eligible, row, live)
            host_cap = self.budgets.cap(row["node_id"], HOST_DEVICE)
            if host_cap is not None:
                usable = min(usable, host_cap)
            candidate = Candidate(
                node_id=row["node_id"],
                name=eligible["name"],
                state=eligible["state"],
                address=eligible["address"],
                rpc_port=int(eligible["rpc_port"]),
                usable_memory_bytes=usable,
                # A cold server needs idle nodes: a node with jobs serves their runtime.
                free_slots=int(eligible["free_slots"]) if eligible["jobs"] == 0 else 0,
                has_model=proves(eligible, sha256, basis) or row["node_id"] in pretend_holding,
                heartbeat_fresh=True,
                slot_cap=min(int(eligible["slots"]), MAX_SLOTS),
                warm=bool(row.get("runtime")),
                devices=node_devices(row, live, self.budgets),
                rpc_protocol=str((row.get("resources") or {}).get("rpc_protocol") or ""),
                links=links_of(row),
            )
        if not fresh:
            self._candidates[row["node_id"]] = (row, live, model_key, candidate)
        return candidate

    def _over_budget(self, plan: ExecutionPlan) -> bool:
        """The plan gives a device more than its budget lowered since (an out-of-memory on it,
        perhaps this very server's setup): the server is not reused, a new plan is made."""
        given = [(d.node_id, d.device, d.assigned_bytes) for d in plan.devices] or [
            (plan.primary.node_id, HOST_DEVICE, plan.primary.assigned_bytes)
        ]
        for node_id, device, assigned in given:
            cap = self.budgets.cap(node_id, device)
            if cap is not None and assigned > cap:
                return True
        return False

    def _current(self, model: dict[str, Any]) -> dict[str, Any]:
        """``model`` with its facts as they are now: a request's row may predate them."""
        current = self.read_model.get_model(model["name"])
        if current is None or current["sha256"] != model["sha256"]:
            return model
        return {**model, "shape": current.get("shape"), "shape_from": current.get("shape_from")}

    def _warm_choices(
        self,
        nodes: dict[str, dict[str, Any]],
        model: dict[str, Any],
        facts: tuple[dict[str, Any], str],
        exclude: frozenset[str],
        connected: Callable[[str], bool] | None,
        live: dict[str, LiveNode],
        *,
        busy: bool = False,
    ) -> list[WarmChoice]:
        """The warm servers that could take a job for ``model`` now (:func:`warm_choices`),
        less those whose plan gives a device more than its budget; ``busy``: those with no
        free slot too. ``live`` is the live state read once for the whole decision."""
        basis = facts[1]

        def reachable(node_id: str) -> bool:
            entry = live.get(node_id)
            return (
                entry is not None and entry.connected and (connected is None or connected(node_id))
            )

        context_size = min(int(model["context_size"]), _needs(model, facts[0]).context_length_max)
        choices = warm_choices(
            nodes,
            model_name=model["name"],
            model_sha256=model["sha256"],
            context_size=context_size,
            exclude=exclude,
            reachable=reachable,
            primary_holds=lambda node_id: proves(nodes[node_id], model["sha256"], basis),
            busy=busy,
        )
        return [choice for choice in choices if not self._over_budget(choice.plan)]

    def next_to_go(
        self,
        model: dict[str, Any],
        waiting: list[tuple[tuple[int, ...], bool]],
        *,
        connected: Callable[[str], bool] | None = None,
    ) -> tuple[int | None, list[int]]:
        """Which of the waiting jobs (the queue's head first) takes a free slot now, by where
        their prompts' prefixes are cached (:meth:`PrefixRouter.next_to_go`)."""
        if not any(chain for chain, _ in waiting):
            return 0, []
        nodes = self.ledger.adjust_all(self.read_model.list_nodes())
        model = self._current(model)
        facts = model_facts(model, nodes)
        if facts is None:
            return 0, []
        live = self.live.all()
        servers = self._warm_choices(nodes, model, facts, frozenset(), connected, live, busy=True)
        return self.router.next_to_go(waiting, servers)

    def place(
        self,
        model: dict[str, Any],
        exclude: frozenset[str] = frozenset(),
        *,
        connected: Callable[[str], bool] | None = None,
        assume_idle: bool = False,
        pretend_holding: frozenset[str] = frozenset(),
        prefix: tuple[int, ...] = (),
        wait_for_cache: bool = False,
    ) -> PlacementResult:
        """A plan for ``model`` now, or why there is none.

        ``prefix`` is the job's prompt prefix chain (:meth:`PrefixRouter.chain`): among warm
        servers the one holding the longest prefix takes the job, within the load bound; the
        server a plan made for real (not ``assume_idle`` nor ``pretend_holding``) goes to is
        remembered as holding it (:meth:`PrefixRouter.sent`).

        ``wait_for_cache``: when the busy server holding the job's longest prefix should take
        it (:meth:`PrefixRouter.next_to_go`), no plan (``WAITS_FOR_CACHE``): the job waits in
        the admission queue for that server's next free slot.

        ``pretend_holding`` plans as if those nodes held the model's file: whether fetching
        it there would let the job run.

        ``connected`` narrows the candidates to nodes whose agents hold a control stream to
        this controller (a controller can only dispatch to those). ``assume_idle`` plans as if
        every in-service node had all its slots free: whether waiting can ever help.
        """
        # This controller's own assignments and releases count at once (the ledger); the
        # read model supplies everyone else's, a little late.
        nodes = self.ledger.adjust_all(self.read_model.list_nodes())
        model = self._current(model)
        facts = model_facts(model, nodes)
        if facts is None:
            return PlacementResult(
                plan=None,
                no_capacity=NoCapacity(
                    f"no node has proven it holds the file of model {model['name']} "
                    f"({model['file_name']}, sha256 {model['sha256'][:12]}…), and the "
                    "controller's model store does not hold it",
                    code=MODEL_NOT_PRESENT,
                ),
            )
        needs = _needs(model, facts[0])
        basis = facts[1]
        live = self.live.all()
        context_size = min(int(model["context_size"]), needs.context_length_max)
        if not assume_idle and not pretend_holding:
            servers = self._warm_choices(nodes, model, facts, exclude, connected, live, busy=True)
            home_busy = wait_for_cache and prefix != ()
            if home_busy and self.router.next_to_go([(prefix, True)], servers)[0] is None:
                return PlacementResult(
                    plan=None,
                    no_capacity=NoCapacity(
                        "the server holding this conversation's prompt prefix is busy; "
                        "the request waits for a slot there",
                        code=WAITS_FOR_CACHE,
                    ),
                )
            choices = [choice for choice in servers if choice.free_slots > 0]
            picked = self.router.choose(prefix, choices)
            if picked is not None:
                warm, route = picked
                self.router.sent(warm.server, prefix, _cache_blocks(needs, warm.plan))
                return PlacementResult(
                    plan=warm.plan, fallback_used=warm.degraded, warm=True, route=route
                )
        candidates = []
        sha256 = model["sha256"]
        for node_id, node in nodes.items():
            entry = live.get(node_id)
            candidate = self._candidate(node, entry, sha256, basis, assume_idle, pretend_holding)
            if candidate is None or candidate.free_slots <= 0:
                continue  # ineligible either way; the planner need not look at it
            if not (
                entry is not None and entry.connected and (connected is None or connected(node_id))
            ):
                candidate = dataclasses.replace(candidate, heartbeat_fresh=False)
            candidates.append(candidate)
        request = PlacementRequest(
            needs=needs,
            context_size=context_size,
            allowed_peer_cidrs=self.config.allowed_peer_cidrs,
            max_nodes=self.config.max_nodes,
            min_link_mbps=self.config.min_link_mbps,
            exclude=exclude,
        )
        result = plan_placement(request, candidates)
        if result.plan is not None and not assume_idle and not pretend_holding:
            plan = result.plan
            self.router.sent(server_of(plan), prefix, _cache_blocks(needs, plan))
        return result
