"""The Node aggregate: one enrolled machine and its state machine (see
docs/lifecycles.md, 'Node state machine').

Every command checks its guard first and raises :class:`IllegalTransition` without
triggering an event when the node's state does not allow it. Event ``apply`` methods
only evolve state; they never check rules, so replay is always possible.
"""

from __future__ import annotations

from typing import Any, ClassVar

from eventsourcing.domain import Aggregate

from domain.errors import IllegalTransition, InvalidCommand
from domain.model_claims import facts_of
from domain.placement import MAX_SLOTS
from domain.runtimes import runtime_capacity, runtime_key
from domain.states import NodeState

#: States that a node in service (not late, lost or broken) can be in.
_IN_SERVICE = frozenset({NodeState.READY, NodeState.BUSY, NodeState.DRAINING})
#: States from which a node can be recovered by a resumed heartbeat or stream.
_RECOVERABLE = frozenset({NodeState.DEGRADED, NodeState.OFFLINE, NodeState.ERROR})
#: States in which a node may run an RPC worker or hold a job.
_CAN_WORK = _IN_SERVICE | {NodeState.DEGRADED}


class Node(Aggregate):
    """An enrolled machine. Its identity is the id given at enrollment."""

    #: Set by NODE_REVOKED, for good (a class default, so snapshots older than it load).
    revoked: bool = False
    #: Set by NODE_STOPPING: its agent drains before it stops (no new job); cleared when it
    #: stops, goes offline, fails or is revoked (a class default, for older snapshots).
    stopping: bool = False

    class Event(Aggregate.Event):
        """A node event; ``state`` is the node's state once the event has happened."""

        code: ClassVar[str] = ""
        state: str

        def apply(self, aggregate: Any) -> None:
            node: Node = aggregate
            self.evolve(node)
            if node.state != self.state:
                node.state = NodeState(self.state)
                node.last_state_change = self.timestamp.isoformat()

        def evolve(self, node: Node) -> None:
            """Changes the node's state; overridden by each event."""

    class Enrolled(Aggregate.Created):
        """Created event; like every node event it carries ``state`` (REGISTERING)."""

        code: ClassVar[str] = "NODE_ENROLLED"
        state: str
        name: str
        inventory: dict[str, Any]
        agent_version: str
        address: str
        rpc_port: int
        labels: dict[str, str]
        slots: int
        credential_sha256: str
        token_id: str

    class BecameReady(Event):
        code: ClassVar[str] = "NODE_READY"

    class ResourcesReported(Event):
        code: ClassVar[str] = "RESOURCES_REPORTED"
        resources: dict[str, Any]
        local_models: list[dict[str, Any]]

        def evolve(self, node: Node) -> None:
            node.resources = self.resources
            node.local_models = self.local_models
            node.proven_models = still_proven(node.proofs(), self.local_models)

    class HeartbeatTimedOut(Event):
        code: ClassVar[str] = "HEARTBEAT_TIMEOUT"
        seconds_since_last: float

    class WentOffline(Event):
        code: ClassVar[str] = "NODE_OFFLINE"
        reason: str
        lost_jobs: list[str]

        def evolve(self, node: Node) -> None:
            node.stopping = False
            node.jobs = []
            node.rpc_workers = {}
            node.runtime = None

    class Stopping(Event):
        """The node's agent was asked to stop (a signal) and drains: it takes no new job,
        and says goodbye once its running jobs end, at most ``drain_timeout_seconds`` later."""

        code: ClassVar[str] = "NODE_STOPPING"
        drain_timeout_seconds: float
        running_jobs: list[str]

        def evolve(self, node: Node) -> None:
            node.stopping = True

    class Stopped(Event):
        """The node's agent said goodbye: it stopped on purpose. Cleanly when ``lost_jobs`` is
        empty; else the jobs it still held are lost (its drain timed out, or a second signal
        stopped it at once), and ``reason`` says which."""

        code: ClassVar[str] = "NODE_STOPPED"
        reason: str
        lost_jobs: list[str]

        def evolve(self, node: Node) -> None:
            node.stopping = False
            node.jobs = []
            node.rpc_workers = {}
            node.runtime = None

    class Recovered(Event):
        code: ClassVar[str] = "NODE_RECOVERED"
        agent_version: str

        def evolve(self, node: Node) -> None:
            if self.agent_version:
                node.agent_version = self.agent_version
            node.error = None
            node.runtime = None  # the agent may have restarted: nothing known to be warm

    class DrainRequested(Event):
        code: ClassVar[str] = "NODE_DRAIN_REQUESTED"
        requested_by: str

        def evolve(self, node: Node) -> None:
            node.drain_requested = True
            node.drained = False

    class Drained(Event):
        code: ClassVar[str] = "NODE_DRAINED"

        def evolve(self, node: Node) -> None:
            node.drained = True

    class Resumed(Event):
        code: ClassVar[str] = "NODE_RESUMED"
        requested_by: str

        def evolve(self, node: Node) -> None:
            node.drain_requested = False
            node.drained = False

    class ErrorReported(Event):
        code: ClassVar[str] = "NODE_ERROR"
        message: str
        lost_jobs: list[str]

        def evolve(self, node: Node) -> None:
            node.stopping = False
            node.error = self.message
            node.jobs = []
            node.rpc_workers = {}
            node.runtime = None

    class RpcWorkerStarted(Event):
        code: ClassVar[str] = "RPC_WORKER_STARTED"
        job_id: str
        host: str
        port: int

        def evolve(self, node: Node) -> None:
            node.rpc_workers = {**node.rpc_workers, self.job_id: f"{self.host}:{self.port}"}

    class RpcWorkerStopped(Event):
        code: ClassVar[str] = "RPC_WORKER_STOPPED"
        job_id: str
        reason: str

        def evolve(self, node: Node) -> None:
            node.rpc_workers = {k: v for k, v in node.rpc_workers.items() if k != self.job_id}

    class RuntimeRetired(Event):
        code: ClassVar[str] = "NODE_RUNTIME_RETIRED"
        #: The runtime (``runtime_of(plan)["key"]``) the node no longer serves.
        runtime_key: str
        idle_seconds: float

        def evolve(self, node: Node) -> None:
            node.runtime = None
            node.rpc_workers = {}

    class LinksMeasured(Event):
        """The node measured its links to peers (``LinkReport``): per peer node id,
        ``{"rtt_ms", "mbps", "error"}`` (an error and zeros when it could not)."""

        code: ClassVar[str] = "NODE_LINKS_MEASURED"
        links: dict[str, dict[str, Any]]

        def evolve(self, node: Node) -> None:
            pass  # the split planner reads them from the read model; the node keeps nothing

    class SecurityViolation(Event):
        code: ClassVar[str] = "SECURITY_VIOLATION"
        address: str
        reason: str
        job_id: str

        def evolve(self, node: Node) -> None:
            node.security_violations += 1

    class Revoked(Event):
        """An administrator revoked the node: its credential is void, its jobs are lost, and
        it may never connect again (it must enroll anew, as another node)."""

        code: ClassVar[str] = "NODE_REVOKED"
        reason: str
        revoked_by: str
        lost_jobs: list[str]

        def evolve(self, node: Node) -> None:
            node.revoked = True
            node.stopping = False
            node.credential_sha256 = ""
            node.jobs = []
            node.rpc_workers = {}
            node.proven_models = {}

    class MessageRejected(Event):
        """The node's agent sent a message the controller could not take (malformed, too
        large, out of order, or about another node's job); ``suppressed`` more were rejected
        since the last such event and not recorded one by one."""

        code: ClassVar[str] = "NODE_MESSAGE_REJECTED"
        kind: str
        job_id: str
        reason: str
        suppressed: int

    class ModelProven(Event):
        """The node answered a challenge of random byte ranges of a registered model's file
        rightly: it may be that model's primary while it reports the file as ``claim`` and
        the model's facts keep their ``basis`` (``store``, or the node that fixed them)."""

        code: ClassVar[str] = "MODEL_PROVEN"
        sha256: str
        basis: str
        claim: dict[str, Any]

        def evolve(self, node: Node) -> None:
            node.proven_models = {
                **node.proofs(),
                self.sha256: {"basis": self.basis, "claim": self.claim},
            }

    class ModelClaimRefused(Event):
        """The node's claim of a registered model's file was refused: it disagrees with the
        model's facts (``basis``; "" when none are known), or the node did not prove it holds
        the file. The file counts for nothing on that node until its claim changes."""

        code: ClassVar[str] = "MODEL_CLAIM_REFUSED"
        sha256: str
        file_name: str
        reason: str
        claim: dict[str, Any]
        basis: str

        def evolve(self, node: Node) -> None:
            node.proven_models = {k: v for k, v in node.proofs().items() if k != self.sha256}

    class ModelTransferStarted(Event):
        """The node began fetching a model file (its own activity, not a job's)."""

        code: ClassVar[str] = "MODEL_TRANSFER_STARTED"
        transfer_id: str
        sha256: str
        file_name: str
        size_bytes: int
        sources: list[str]

        def evolve(self, node: Node) -> None:
            node.transfers = {
                **node.transfers,
                self.transfer_id: {"sha256": self.sha256, "file_name": self.file_name},
            }

    class ModelTransferProgressed(Event):
        code: ClassVar[str] = "MODEL_TRANSFER_PROGRESS"
        transfer_id: str
        bytes_done: int
        size_bytes: int

    class ModelTransferCompleted(Event):
        code: ClassVar[str] = "MODEL_TRANSFER_COMPLETED"
        transfer_id: str
        sha256: str
        source_node_id: str

        def evolve(self, node: Node) -> None:
            node.transfers = {k: v for k, v in node.transfers.items() if k != self.transfer_id}

    class ModelTransferFailed(Event):
        code: ClassVar[str] = "MODEL_TRANSFER_FAILED"
        transfer_id: str
        sha256: str
        error: str

        def evolve(self, node: Node) -> None:
            node.transfers = {k: v for k, v in node.transfers.items() if k != self.transfer_id}

    class ModelEvicted(Event):
        """An operator had a model file deleted from the node's models directory."""

        code: ClassVar[str] = "MODEL_EVICTED"
        sha256: str
        file_name: str

    class JobAssigned(Event):
        code: ClassVar[str] = "NODE_JOB_ASSIGNED"
        job_id: str
        role: str
        #: The server the job runs on (``domain.runtimes.runtime_of``); None before slots.
        runtime: dict[str, Any] | None = None

        def evolve(self, node: Node) -> None:
            node.jobs = sorted({*node.jobs, self.job_id})
            node.runtime = self.runtime

    class JobReleased(Event):
        code: ClassVar[str] = "NODE_JOB_RELEASED"
        job_id: str
        outcome: str

        def evolve(self, node: Node) -> None:
            node.jobs = [j for j in node.jobs if j != self.job_id]
            # The worker process may stay warm for the next job; its claim for this one ends.
            node.rpc_workers = {k: v for k, v in node.rpc_workers.items() if k != self.job_id}

    def __init__(
        self,
        state: str,
        name: str,
        inventory: dict[str, Any],
        agent_version: str,
        address: str,
        rpc_port: int,
        labels: dict[str, str],
        slots: int,
        credential_sha256: str,
        token_id: str,
    ) -> None:
        self.name = name
        self.inventory = inventory
        self.agent_version = agent_version
        self.address = address
        self.rpc_port = rpc_port
        self.labels = labels
        self.slots = slots
        self.credential_sha256 = credential_sha256
        self.token_id = token_id
        self.state = NodeState(state)
        self.last_state_change = self.created_on.isoformat()
        self.drain_requested = False
        self.drained = False
        self.jobs: list[str] = []
        self.rpc_workers: dict[str, str] = {}
        self.resources: dict[str, Any] = {}
        self.local_models: list[dict[str, Any]] = []
        self.error: str | None = None
        self.security_violations = 0
        #: Model fetches under way, by transfer id.
        self.transfers: dict[str, dict[str, str]] = {}
        #: The (warm) server this node serves, kept after its last job: ``runtime_of(plan)``.
        self.runtime: dict[str, Any] | None = None
        #: Model files the node proved it holds: sha256 → {"basis", "claim"} (MODEL_PROVEN;
        #: read with :meth:`proofs`, since snapshots older than it lack the attribute).
        self.proven_models: dict[str, dict[str, Any]] = {}

    # ----------------------------------------------------------------- queries

    def settled_state(self, *, jobs: int | None = None, drain: bool | None = None) -> NodeState:
        """The in-service state that a job count and drain flag call for (default: current).
        A stopping node drains whatever the flag says."""
        return settled_state(
            len(self.jobs) if jobs is None else jobs,
            self.capacity,
            (self.drain_requested if drain is None else drain) or self.stopping,
        )

    def proofs(self) -> dict[str, dict[str, Any]]:
        """The model files the node proved it holds (see :attr:`proven_models`)."""
        return dict(getattr(self, "proven_models", {}))

    @property
    def capacity(self) -> int:
        """Jobs the node can hold at once: its runtime's slots (its own cap before any)."""
        return runtime_capacity(self.runtime, self.slots)

    @property
    def schedulable(self) -> bool:
        return self.state == NodeState.READY and len(self.jobs) < self.capacity

    @property
    def drain_complete(self) -> bool:
        return self.drain_requested and self.drained

    def _refuse(self, command: str, detail: str = "") -> IllegalTransition:
        return IllegalTransition("node", command, str(self.state), detail)

    # ---------------------------------------------------------------- commands

    @classmethod
    def enroll(
        cls,
        *,
        node_id: Any,
        name: str,
        inventory: dict[str, Any],
        agent_version: str,
        address: str,
        rpc_port: int,
        labels: dict[str, str],
        credential_sha256: str,
        token_id: str,
        slots: int = 1,
    ) -> Node:
        if not name.strip():
            raise InvalidCommand("a node needs a non-empty name")
        if slots < 1:
            raise InvalidCommand("a node needs at least one job slot")
        # Its own figure (it runs the work), within reason: the planner tries every count.
        slots = min(slots, MAX_SLOTS)
        return cls._create(
            cls.Enrolled,
            id=node_id,
            state=NodeState.REGISTERING,
            name=name,
            inventory=inventory,
            agent_version=agent_version,
            address=address,
            rpc_port=rpc_port,
            labels=labels,
            slots=slots,
            credential_sha256=credential_sha256,
            token_id=token_id,
        )

    def become_ready(self) -> None:
        if self.revoked or self.state != NodeState.REGISTERING:
            raise self._refuse("become ready", "only a registering node becomes ready")
        self.trigger_event(self.BecameReady, state=self.settled_state())

    def report_resources(
        self, resources: dict[str, Any], local_models: list[dict[str, Any]]
    ) -> bool:
        """Records the report when it differs meaningfully; returns whether it did."""
        if not resources_differ(self.resources, resources) and self.local_models == local_models:
            return False
        self.trigger_event(
            self.ResourcesReported,
            state=self.state,
            resources=resources,
            local_models=local_models,
        )
        return True

    def heartbeat_timeout(self, seconds_since_last: float) -> None:
        if self.state not in _IN_SERVICE:
            raise self._refuse("time out", "only a node in service can become late")
        self.trigger_event(
            self.HeartbeatTimedOut, state=NodeState.DEGRADED, seconds_since_last=seconds_since_last
        )

    def go_offline(self, reason: str) -> None:
        if self.state == NodeState.OFFLINE:
            raise self._refuse("go offline", "already offline")
        self.trigger_event(
            self.WentOffline, state=NodeState.OFFLINE, reason=reason, lost_jobs=list(self.jobs)
        )

    def revoke(self, reason: str, revoked_by: str) -> None:
        if self.revoked:
            raise self._refuse("revoke", "already revoked")
        self.trigger_event(
            self.Revoked,
            state=NodeState.OFFLINE,
            reason=reason,
            revoked_by=revoked_by,
            lost_jobs=list(self.jobs),
        )

    def stop_draining(self, drain_timeout_seconds: float) -> None:
        """NODE_STOPPING: its agent stops once its jobs end (within the timeout); until then
        the node drains (DRAINING while in service) and takes no new job."""
        if self.revoked or self.state in (NodeState.OFFLINE, NodeState.REGISTERING):
            raise self._refuse("stop", "the node is not in service")
        if self.stopping:
            raise self._refuse("stop", "it is stopping already")
        if drain_timeout_seconds < 0:
            raise InvalidCommand(f"invalid drain timeout {drain_timeout_seconds}")
        state = NodeState.DRAINING if self.state in _IN_SERVICE else self.state
        self.trigger_event(
            self.Stopping,
            state=state,
            drain_timeout_seconds=drain_timeout_seconds,
            running_jobs=list(self.jobs),
        )

    def stopped(self, reason: str) -> None:
        """NODE_STOPPED: its agent said goodbye; the jobs it still holds are lost."""
        if self.state == NodeState.OFFLINE:
            raise self._refuse("stop", "already offline")
        self.trigger_event(
            self.Stopped, state=NodeState.OFFLINE, reason=reason, lost_jobs=list(self.jobs)
        )

    def recover(self, agent_version: str = "") -> None:
        if self.revoked:
            raise self._refuse("recover", "the node was revoked")
        if self.state not in _RECOVERABLE:
            raise self._refuse("recover", "only a degraded, offline or failed node recovers")
        self.trigger_event(
            self.Recovered, state=self.settled_state(jobs=0), agent_version=agent_version
        )

    def request_drain(self, requested_by: str) -> None:
        if self.drain_requested:
            raise self._refuse("drain", "a drain is already requested")
        if self.state == NodeState.REGISTERING:
            raise self._refuse("drain", "the node has not finished registering")
        state = NodeState.DRAINING if self.state in _IN_SERVICE else self.state
        self.trigger_event(self.DrainRequested, state=state, requested_by=requested_by)

    def complete_drain_if_idle(self) -> bool:
        """Records NODE_DRAINED when a requested drain has no job left; returns whether."""
        if not self.drain_requested or self.drained or self.jobs:
            return False
        self.trigger_event(self.Drained, state=self.state)
        return True

    def resume(self, requested_by: str) -> None:
        if not self.drain_requested:
            raise self._refuse("resume", "no drain was requested")
        state = self.settled_state(drain=False) if self.state in _IN_SERVICE else self.state
        self.trigger_event(self.Resumed, state=state, requested_by=requested_by)

    def report_error(self, message: str) -> None:
        if self.state in (NodeState.OFFLINE, NodeState.ERROR, NodeState.REGISTERING):
            raise self._refuse("enter error", "the node is not running")
        self.trigger_event(
            self.ErrorReported, state=NodeState.ERROR, message=message, lost_jobs=list(self.jobs)
        )

    def rpc_worker_started(self, job_id: str, host: str, port: int) -> None:
        if self.state not in _CAN_WORK:
            raise self._refuse("start an RPC worker")
        if job_id not in self.jobs:
            raise self._refuse("start an RPC worker", f"job {job_id} is not assigned to it")
        if not 0 < port < 65536:
            raise InvalidCommand(f"invalid RPC port {port}")
        self.trigger_event(
            self.RpcWorkerStarted, state=self.state, job_id=job_id, host=host, port=port
        )

    def links_measured(self, links: dict[str, dict[str, Any]]) -> None:
        if self.revoked:
            raise self._refuse("record its links", "the node was revoked")
        self.trigger_event(self.LinksMeasured, state=self.state, links=links)

    def rpc_worker_stopped(self, job_id: str, reason: str) -> None:
        if job_id not in self.rpc_workers:
            raise self._refuse("stop an RPC worker", f"no worker runs for job {job_id}")
        self.trigger_event(self.RpcWorkerStopped, state=self.state, job_id=job_id, reason=reason)

    def transfer_started(
        self, transfer_id: str, sha256: str, file_name: str, size_bytes: int, sources: list[str]
    ) -> None:
        if transfer_id in self.transfers:
            raise self._refuse("start a transfer", f"transfer {transfer_id} runs already")
        self.trigger_event(
            self.ModelTransferStarted,
            state=self.state,
            transfer_id=transfer_id,
            sha256=sha256,
            file_name=file_name,
            size_bytes=size_bytes,
            sources=sources,
        )

    def _transfer(self, transfer_id: str, what: str) -> dict[str, str]:
        transfer = self.transfers.get(transfer_id)
        if transfer is None:
            raise self._refuse(what, f"no transfer {transfer_id} runs")
        return transfer

    def transfer_progressed(self, transfer_id: str, bytes_done: int, size_bytes: int) -> None:
        self._transfer(transfer_id, "record transfer progress")
        self.trigger_event(
            self.ModelTransferProgressed,
            state=self.state,
            transfer_id=transfer_id,
            bytes_done=bytes_done,
            size_bytes=size_bytes,
        )

    def transfer_completed(self, transfer_id: str, source_node_id: str) -> None:
        transfer = self._transfer(transfer_id, "complete a transfer")
        self.trigger_event(
            self.ModelTransferCompleted,
            state=self.state,
            transfer_id=transfer_id,
            sha256=transfer["sha256"],
            source_node_id=source_node_id,
        )

    def transfer_failed(self, transfer_id: str, error: str) -> None:
        transfer = self._transfer(transfer_id, "fail a transfer")
        self.trigger_event(
            self.ModelTransferFailed,
            state=self.state,
            transfer_id=transfer_id,
            sha256=transfer["sha256"],
            error=error,
        )

    def model_evicted(self, sha256: str, file_name: str) -> None:
        self.trigger_event(self.ModelEvicted, state=self.state, sha256=sha256, file_name=file_name)

    def retire_runtime(self, key: str, idle_seconds: float) -> None:
        """The node stops serving the runtime ``key`` (its RPC worker is stopped): only when
        it holds no job, and still serves that runtime (a job assigned meanwhile wins)."""
        if runtime_key(self.runtime) != key:
            raise self._refuse("retire a runtime", f"it does not serve runtime {key}")
        if self.jobs:
            raise self._refuse("retire a runtime", f"it holds {len(self.jobs)} job(s)")
        self.trigger_event(
            self.RuntimeRetired, state=self.state, runtime_key=key, idle_seconds=idle_seconds
        )

    def model_proven(self, sha256: str, basis: str, claim: dict[str, Any]) -> None:
        if self.revoked:
            raise self._refuse("prove a model file", "the node was revoked")
        reported = [facts_of(m) for m in self.local_models if m.get("sha256") == sha256]
        if claim not in reported:
            raise self._refuse("prove a model file", f"it no longer reports {sha256[:12]} so")
        self.trigger_event(
            self.ModelProven, state=self.state, sha256=sha256, basis=basis, claim=claim
        )

    def refuse_model_claim(
        self, sha256: str, file_name: str, reason: str, claim: dict[str, Any], basis: str
    ) -> None:
        self.trigger_event(
            self.ModelClaimRefused,
            state=self.state,
            sha256=sha256,
            file_name=file_name,
            reason=reason,
            claim=claim,
            basis=basis,
        )

    def security_violation(self, address: str, reason: str, job_id: str = "") -> None:
        self.trigger_event(
            self.SecurityViolation, state=self.state, address=address, reason=reason, job_id=job_id
        )

    def reject_message(self, kind: str, job_id: str, reason: str, suppressed: int = 0) -> None:
        self.trigger_event(
            self.MessageRejected,
            state=self.state,
            kind=kind,
            job_id=job_id,
            reason=reason,
            suppressed=suppressed,
        )

    def assign_job(
        self,
        job_id: str,
        role: str,
        *,
        allow_degraded: bool = False,
        runtime: dict[str, Any] | None = None,
    ) -> None:
        """Takes ``job_id`` on the server ``runtime`` (``domain.runtimes.runtime_of``).

        A node serves one runtime at a time: while it has jobs, only jobs of the same runtime
        join them, up to the runtime's slots. With no job left it may switch runtime.
        """
        allowed = {NodeState.READY} | ({NodeState.DEGRADED} if allow_degraded else set())
        if self.state not in allowed or self.drain_requested or self.stopping:
            raise self._refuse("take a job", "it is not schedulable")
        if job_id in self.jobs:
            raise self._refuse("take a job", f"job {job_id} is already assigned")
        if self.jobs and runtime_key(runtime) != runtime_key(self.runtime):
            raise self._refuse("take a job", "its slots serve another model, context or split")
        capacity = runtime_capacity(runtime, self.slots)
        if role == "primary" and capacity > self.slots:
            raise InvalidCommand(f"the node offers {self.slots} slot(s), not {capacity}")
        if len(self.jobs) >= capacity:
            raise self._refuse("take a job", "every slot is taken")
        state = (
            settled_state(len(self.jobs) + 1, capacity, False)
            if self.state in _IN_SERVICE
            else self.state
        )
        self.trigger_event(self.JobAssigned, state=state, job_id=job_id, role=role, runtime=runtime)

    def release_job(self, job_id: str, outcome: str) -> None:
        if job_id not in self.jobs:
            raise self._refuse("release a job", f"job {job_id} is not assigned to it")
        state = (
            self.settled_state(jobs=len(self.jobs) - 1) if self.state in _IN_SERVICE else self.state
        )
        self.trigger_event(self.JobReleased, state=state, job_id=job_id, outcome=outcome)


def still_proven(
    proofs: dict[str, dict[str, Any]], local_models: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The proofs a new report keeps: those of files it still claims exactly as proven."""
    claims = {str(m.get("sha256")): facts_of(m) for m in local_models}
    return {sha: p for sha, p in proofs.items() if claims.get(sha) == p.get("claim")}


def settled_state(jobs: int, slots: int, drain_requested: bool) -> NodeState:
    """READY, BUSY or DRAINING: the state of a node in service."""
    if drain_requested:
        return NodeState.DRAINING
    if jobs >= slots:
        return NodeState.BUSY
    return NodeState.READY


#: Relative change in free memory that counts as meaningful for RESOURCES_REPORTED.
MEANINGFUL_MEMORY_CHANGE = 0.10


def resources_differ(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether a resource report is worth an event: anything but free-memory jitter.

    Keys ending in ``_free_bytes`` change with every allocation; they count only when
    they move by more than :data:`MEANINGFUL_MEMORY_CHANGE` of their previous value.
    Any other difference (a GPU appears, a model file is added) always counts.
    """
    if before.keys() != after.keys():
        return True
    for key, old in before.items():
        new = after[key]
        if key.endswith("_free_bytes") and isinstance(old, int) and isinstance(new, int):
            if abs(new - old) > MEANINGFUL_MEMORY_CHANGE * max(old, 1):
                return True
        elif isinstance(old, dict) and isinstance(new, dict):
            if resources_differ(old, new):
                return True
        elif isinstance(old, list) and isinstance(new, list):
            if len(old) != len(new):
                return True
            for a, b in zip(old, new, strict=True):
                if isinstance(a, dict) and isinstance(b, dict):
                    if resources_differ(a, b):
                        return True
                elif a != b:
                    return True
        elif old != new:
            return True
    return False
