"""Who may reach each node's RPC worker: the primaries of this controller's jobs that use it.

``ggml-rpc-server`` has no authentication; the agent's gate lets in only the addresses the
controller names. The set is exact, never a sum of past ones: each ``StartRpcWorker`` carries
the primaries of every job of this controller that uses the worker now (the new job's
included), which replaces what the worker let in before; when a job stops using the worker (it
ended, or a re-plan moved it) the worker hears the set of the jobs left (``RpcWorkerPeers``), so
a former primary can no longer open a connection. A node serves one runtime at a time, so its
jobs share one primary; the set holds more only while a runtime changes hands.

Pure bookkeeping, no I/O: the job manager sends what it returns.
"""

from __future__ import annotations

from application.ports import AllowedPeer
from domain.placement import ExecutionPlan, PlanNode


def rpc_worker_nodes(plan: ExecutionPlan) -> tuple[PlanNode, ...]:
    """The nodes of ``plan`` that run a ``ggml-rpc-server`` for it, in plan order: those with a
    device reached over RPC; in a plan without devices (recorded before them), every node of
    a multi-node plan."""
    if not plan.devices:
        return plan.nodes if plan.workers else ()
    remote = {d.node_id for d in plan.devices if d.via_rpc}
    return tuple(n for n in plan.nodes if n.node_id in remote)


def worker_devices(plan: ExecutionPlan, node_id: str) -> tuple[str, ...]:
    """The devices ``node_id``'s RPC worker exposes for ``plan`` (``ggml-rpc-server -d``), in
    plan order: llama-server numbers RPC devices in that order (``RPC0``, ``RPC1``, ...), so the
    primary's ``--device`` list and the workers' ``-d`` lists agree. Empty: the worker's
    default (a plan without devices)."""
    return tuple(d.device for d in plan.devices if d.via_rpc and d.node_id == node_id)


class WorkerAccess:
    def __init__(self) -> None:
        #: worker node → job → the job's primary.
        self._users: dict[str, dict[str, AllowedPeer]] = {}

    def use(self, job_id: str, plan: ExecutionPlan) -> None:
        """``job_id`` runs ``plan``: its primary may reach every RPC worker of the plan (the
        primary's own included, where its CPU takes a share through it). A job whose plan
        needs no RPC worker uses none."""
        self.release(job_id)
        primary = AllowedPeer(plan.primary.node_id, plan.primary.address)
        for node in rpc_worker_nodes(plan):
            self._users.setdefault(node.node_id, {})[job_id] = primary

    def allowed(self, node_id: str) -> tuple[AllowedPeer, ...]:
        """The exact set that may reach ``node_id``'s worker now."""
        return tuple(sorted(set(self._users.get(node_id, {}).values())))

    def release(self, job_id: str) -> dict[str, tuple[AllowedPeer, ...]]:
        """``job_id`` no longer uses any worker; returns, for each worker whose set that
        changed, the set left (possibly empty)."""
        changed: dict[str, tuple[AllowedPeer, ...]] = {}
        for node_id, users in list(self._users.items()):
            if job_id not in users:
                continue
            before = self.allowed(node_id)
            del users[job_id]
            if not users:
                del self._users[node_id]
            after = self.allowed(node_id)
            if after != before:
                changed[node_id] = after
        return changed

    def jobs(self) -> set[str]:
        """Every job that uses a worker (tests)."""
        return {job for users in self._users.values() for job in users}
