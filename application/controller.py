"""The controller application: one command per transition, over the event store.

Each command loads the aggregates it needs, calls their guarded methods and returns every
changed aggregate; :class:`~application.aggregate_store.AggregateStore` saves them in one
transaction, re-running the command on a version conflict, failing fast while the store is
unreachable, keeping unfinished jobs as last saved and telling listeners where a save reached.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Unpack
from uuid import UUID, uuid4

import orjson
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import Recording

from application.aggregate_store import AggregateStore, SaveListener
from application.commands import (
    CommandResult,
    Delta,
    Enrollment,
    FetchRequest,
    JobOutcome,
    Submission,
    TransferReport,
)
from application.errors import NotFound, TokenAlreadyUsed, TokenRevoked
from application.store_guard import StoreGuard
from common.contract import JobErrorCode
from domain.access_refusal import AccessRefusal, RefusalTerms
from domain.api_key import ApiKey
from domain.errors import DomainError, IllegalTransition, InvalidCommand, SlotTaken
from domain.issued_token import IssuedToken, TokenTerms, issued_token_id
from domain.job import Job
from domain.model import CHAT, DEFAULT_CONTEXT_SIZE, RegisteredModel, model_id
from domain.model_claims import STORE, Samples, facts_of
from domain.node import Node
from domain.placement import ExecutionPlan
from domain.runtimes import runtime_of
from domain.states import EXECUTION_PHASE_STATES, TERMINAL_JOB_STATES
from domain.token_redemption import TokenRedemption, redemption_id

#: What a NotFound calls each aggregate ("unknown node ...").
KINDS: dict[type[Aggregate], str] = {
    Node: "node",
    Job: "job",
    RegisteredModel: "model",
    ApiKey: "api_key",
}

log = logging.getLogger(__name__)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _kept_fresh(aggregate: Aggregate) -> bool:
    """Kept as last saved, so the next command starts from this copy instead of a store
    query and a deep copy of the repository's cached one:

    * an unfinished job: written by the one controller that runs it (the cost grew with
      every token chunk);
    * a node: written by the controller its agent is connected to, which places jobs only on
      such nodes. Every job's dispatch and ending change its nodes, and loading a node was a
      tenth of the controller's CPU per request. Another controller's write (an admin's
      drain, a node moving) makes the next save here conflict, which re-runs the command on
      the stored node."""
    if isinstance(aggregate, Job):
        return aggregate.state not in TERMINAL_JOB_STATES
    return isinstance(aggregate, Node)


class Controller(Application[UUID]):
    """Event-sourced controller state: nodes, jobs and token redemptions."""

    name = "dacp"
    snapshotting_intervals: ClassVar[dict[Any, int]] = {Node: 50}  # type: ignore[misc]
    env: ClassVar[dict[str, str]] = {  # type: ignore[misc]
        "AGGREGATE_CACHE_MAXSIZE": "2000",
        "AGGREGATE_CACHE_FASTFORWARD": "y",
    }

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        record_content: bool = True,
        guard: StoreGuard | None = None,
    ):
        super().__init__(env)
        self.record_content = record_content
        #: This controller process's id, recorded with every job it submits: another
        #: controller sharing the store leaves a job alone while its owner's lease lives.
        self.owner = ""
        #: Fails commands fast while the store is unreachable (storage gives it a probe).
        self.guard = guard if guard is not None else StoreGuard(probe=lambda: True)
        #: Loading, saving with retries, fresh jobs and save listeners: the store mechanics.
        self.aggregates = AggregateStore(self, self.guard, kinds=KINDS, keep_fresh=_kept_fresh)

    # -------------------------------------------- the store (AggregateStore's)

    @property
    def append_observer(self) -> Callable[[float], None] | None:
        """Called with each successful save's duration in seconds (event-store latency)."""
        return self.aggregates.append_observer

    @append_observer.setter
    def append_observer(self, observer: Callable[[float], None] | None) -> None:
        self.aggregates.append_observer = observer

    def add_save_listener(self, listener: SaveListener) -> None:
        """Calls ``listener(position)`` after every save (projections wake on it)."""
        self.aggregates.add_save_listener(listener)

    def remove_save_listener(self, listener: SaveListener) -> None:
        self.aggregates.remove_save_listener(listener)

    def _notify(self, recordings: list[Recording[UUID]]) -> None:
        self.aggregates.notify(recordings)

    def position(self) -> int:
        """The store's current maximum notification id (0 when empty)."""
        return self.aggregates.position()

    def get_node(self, node_id: UUID | str) -> Node:
        return self.aggregates.get(Node, node_id)

    def get_job(self, job_id: UUID | str) -> Job:
        return self.aggregates.get(Job, job_id)

    # ---------------------------------------------------------- node commands

    def enroll(self, enrollment: Enrollment, node_id: UUID | None = None) -> CommandResult:
        new_id = node_id or uuid4()

        def command() -> list[Aggregate]:
            saved: list[Aggregate] = []
            # A revoked token enrolls nobody (one minted outside dacp has no record: it was
            # made by someone holding NODE_ENROLLMENT_SECRET, whom the cluster trusts anyway).
            issued = self.aggregates.find(IssuedToken, issued_token_id(enrollment.token_id))
            if issued is not None and issued.revoked:
                raise TokenRevoked(enrollment.token_id)
            if enrollment.single_use_token:
                redeemed = self.aggregates.find(TokenRedemption, redemption_id(enrollment.token_id))
                if redeemed is not None:
                    raise TokenAlreadyUsed(enrollment.token_id)
                saved.append(TokenRedemption.redeem(enrollment.token_id, str(new_id)))
            node = Node.enroll(
                node_id=new_id,
                name=enrollment.name,
                inventory=enrollment.inventory,
                agent_version=enrollment.agent_version,
                address=enrollment.address,
                rpc_port=enrollment.rpc_port,
                labels=enrollment.labels,
                credential_sha256=enrollment.credential_sha256,
                token_id=enrollment.token_id,
                slots=enrollment.slots,
            )
            return [node, *saved]

        return CommandResult(self.aggregates.run(command), new_id)

    def mark_ready(self, node_id: UUID | str) -> int:
        return self.aggregates.change(Node, node_id, lambda n: n.become_ready())

    def report_resources(
        self, node_id: UUID | str, resources: dict[str, Any], local_models: list[dict[str, Any]]
    ) -> int:
        return self.aggregates.change(
            Node, node_id, lambda n: n.report_resources(resources, local_models)
        )

    def heartbeat_timeout(self, node_id: UUID | str, seconds_since_last: float) -> int:
        return self.aggregates.change(
            Node, node_id, lambda n: n.heartbeat_timeout(seconds_since_last)
        )

    def mark_offline(self, node_id: UUID | str, reason: str) -> int:
        return self._node_lost(node_id, lambda n: n.go_offline(reason), reason)

    def mark_stopping(self, node_id: UUID | str, drain_timeout_seconds: float) -> int:
        """NODE_STOPPING: the node's agent drains before it stops; no new job goes to it."""
        return self.aggregates.change(
            Node, node_id, lambda n: n.stop_draining(drain_timeout_seconds)
        )

    def mark_stopped(self, node_id: UUID | str, reason: str) -> int:
        """NODE_STOPPED: the node's agent said goodbye; the jobs it still held fail with it."""
        return self._node_lost(
            node_id, lambda n: n.stopped(reason), f"its agent stopped ({reason})"
        )

    def report_node_error(self, node_id: UUID | str, message: str) -> int:
        return self._node_lost(node_id, lambda n: n.report_error(message), message)

    def _node_lost(self, node_id: UUID | str, act: Callable[[Node], None], reason: str) -> int:
        """Offline or error: the node's executing jobs end with it, in the same transaction.

        Jobs still in setup are left to the job manager, which re-plans them without the
        node (see docs/faults.md, 'Node lost'); the node's claim on them is dropped
        with the node's state.
        """

        def command() -> list[Aggregate]:
            node = self.aggregates.load(Node, node_id)
            lost = list(node.jobs)
            act(node)
            changed: dict[UUID, Aggregate] = {node.id: node}
            for job_id in lost:
                job = self.aggregates.load(Job, job_id)
                if job.state in EXECUTION_PHASE_STATES:
                    job.fail(
                        f"node {node.name} lost: {reason}", JobErrorCode.NODE_LOST_IN_EXECUTION
                    )
                    changed[job.id] = job
                    self._release_nodes(job, changed, outcome="failed")
            node.complete_drain_if_idle()
            return list(changed.values())

        return self.aggregates.run(command)

    def revoke_node(self, node_id: UUID | str, reason: str, revoked_by: str) -> int:
        """NODE_REVOKED: the credential is void and the node's executing jobs fail with it,
        in one transaction. Controllers react to the event (stream closed, clients told)."""
        return self._node_lost(
            node_id, lambda n: n.revoke(reason, revoked_by), f"revoked ({reason})"
        )

    def mark_recovered(self, node_id: UUID | str, agent_version: str = "") -> int:
        return self.aggregates.change(Node, node_id, lambda n: n.recover(agent_version))

    def request_drain(self, node_id: UUID | str, requested_by: str = "admin") -> int:
        def act(node: Node) -> None:
            node.request_drain(requested_by)
            node.complete_drain_if_idle()

        return self.aggregates.change(Node, node_id, act)

    def mark_drained(self, node_id: UUID | str) -> int:
        """Records NODE_DRAINED if the node's drain is requested and it holds no job."""
        return self.aggregates.change(Node, node_id, lambda n: n.complete_drain_if_idle())

    def resume(self, node_id: UUID | str, requested_by: str = "admin") -> int:
        return self.aggregates.change(Node, node_id, lambda n: n.resume(requested_by))

    def rpc_worker_started(self, node_id: UUID | str, job_id: str, host: str, port: int) -> int:
        return self.aggregates.change(
            Node, node_id, lambda n: n.rpc_worker_started(job_id, host, port)
        )

    def transfer_started(self, node_id: UUID | str, request: FetchRequest) -> int:
        """MODEL_TRANSFER_STARTED: the node began fetching a model file."""
        return self.aggregates.change(
            Node,
            node_id,
            lambda n: n.transfer_started(
                request.transfer_id,
                request.sha256,
                request.file_name,
                request.size_bytes,
                [s.node_id or s.url for s in request.sources],
            ),
        )

    def transfer_reported(self, node_id: UUID | str, report: TransferReport) -> int:
        """MODEL_TRANSFER_PROGRESS, _COMPLETED or _FAILED, as the node reported."""

        def act(node: Node) -> None:
            if report.state == "progress":
                node.transfer_progressed(report.transfer_id, report.bytes_done, report.size_bytes)
            elif report.state == "completed":
                node.transfer_completed(report.transfer_id, report.source_node_id)
            else:
                node.transfer_failed(report.transfer_id, report.error or "failed")

        return self.aggregates.change(Node, node_id, act)

    def model_evicted(self, node_id: UUID | str, sha256: str, file_name: str) -> int:
        """MODEL_EVICTED: the node deleted a model file, as an operator asked."""
        return self.aggregates.change(Node, node_id, lambda n: n.model_evicted(sha256, file_name))

    def retire_runtime(self, node_id: UUID | str, key: str, idle_seconds: float) -> int:
        """NODE_RUNTIME_RETIRED: the node no longer serves the idle runtime ``key``."""
        return self.aggregates.change(Node, node_id, lambda n: n.retire_runtime(key, idle_seconds))

    def record_links(self, node_id: UUID | str, links: dict[str, dict[str, Any]]) -> int:
        """NODE_LINKS_MEASURED: what the node measured of its links to its peers."""
        return self.aggregates.change(Node, node_id, lambda n: n.links_measured(links))

    def rpc_worker_stopped(self, node_id: UUID | str, job_id: str, reason: str) -> int:
        return self.aggregates.change(Node, node_id, lambda n: n.rpc_worker_stopped(job_id, reason))

    def record_token(self, token_id: str, **terms: Unpack[TokenTerms]) -> int:
        """ENROLLMENT_TOKEN_MINTED: the token and its terms, so it can be listed and revoked."""
        issued = IssuedToken.mint(token_id, **terms)
        return self.aggregates.run(lambda: [issued])

    def revoke_token(self, token_id: str, revoked_by: str, reason: str) -> int:
        """ENROLLMENT_TOKEN_REVOKED: no enrollment with it from now on (NotFound: never
        minted here)."""

        def command() -> list[Aggregate]:
            issued = self.aggregates.find(IssuedToken, issued_token_id(token_id))
            if issued is None:
                raise NotFound("enrollment token", token_id)
            issued.revoke(revoked_by, reason)
            return [issued]

        return self.aggregates.run(command)

    def refuse_access(self, **terms: Unpack[RefusalTerms]) -> int:
        """Records a refused enrollment or control stream (ACCESS_REFUSED)."""
        refusal = AccessRefusal.record(**terms)
        return self.aggregates.run(lambda: [refusal])

    def security_violation(
        self, node_id: UUID | str, address: str, reason: str, job_id: str = ""
    ) -> int:
        return self.aggregates.change(
            Node, node_id, lambda n: n.security_violation(address, reason, job_id)
        )

    def model_proven(
        self, node_id: UUID | str, sha256: str, basis: str, claim: dict[str, Any]
    ) -> int:
        """MODEL_PROVEN: the node answered a challenge of the file's byte ranges rightly."""
        return self.aggregates.change(Node, node_id, lambda n: n.model_proven(sha256, basis, claim))

    def refuse_model_claim(
        self,
        node_id: UUID | str,
        sha256: str,
        file_name: str,
        reason: str,
        claim: dict[str, Any],
        basis: str,
    ) -> int:
        """MODEL_CLAIM_REFUSED: the node's claim of a registered model's file counts for
        nothing (it disagrees with the model's facts, or was not proven)."""
        return self.aggregates.change(
            Node,
            node_id,
            lambda n: n.refuse_model_claim(sha256, file_name, reason, claim, basis),
        )

    def prove_first(
        self, node_id: UUID | str, name: str, sha256: str, claim: dict[str, Any], samples: Samples
    ) -> int:
        """A first proof of a file only nodes hold: the node's claim fixes the model's facts
        (MODEL_SHAPE_FIXED, with its answers as the samples later proofs are checked
        against) and the node is proven (MODEL_PROVEN), in one transaction. Refused when the
        facts are known already, unless the node that fixed them has been revoked since."""

        def command() -> list[Aggregate]:
            model: RegisteredModel = self.aggregates.get(RegisteredModel, model_id(name))
            if model.sha256 != sha256:
                raise InvalidCommand(f"model {name} is registered to another file now")
            fixer_revoked = self._fixer_revoked(model)
            node = self.aggregates.load(Node, node_id)
            nonce, recorded = samples.to_event()
            model.fix_shape(
                facts_of(claim), str(node.id), nonce, recorded, fixer_revoked=fixer_revoked
            )
            node.model_proven(sha256, str(node.id), facts_of(claim))
            return [model, node]

        return self.aggregates.run(command)

    def sample_stored_model(self, name: str, sha256: str, samples: Samples) -> int:
        """MODEL_SHAPE_FIXED from the controller's own copy: samples of the stored file, so
        that proofs can be checked once the store no longer holds it."""

        def act(model: RegisteredModel) -> None:
            if model.sha256 != sha256:
                raise InvalidCommand(f"model {name} is registered to another file now")
            nonce, recorded = samples.to_event()
            model.fix_shape(dict(getattr(model, "shape", None) or {}), STORE, nonce, recorded)

        return self._model_command(name, act).position

    def _fixer_revoked(self, model: RegisteredModel) -> bool:
        """Whether the node that fixed the model's facts is revoked (or gone) since: then
        its facts count for nothing, and new ones may be fixed."""
        fixer = getattr(model, "shape_from", None)
        if fixer is None or fixer == STORE:
            return False
        try:
            return bool(self.aggregates.get(Node, fixer).revoked)
        except NotFound:
            return True

    def share_model_facts(self, name: str, holder: str) -> int:
        """Model ``name`` takes the facts of model ``holder``, another name of the same file
        (MODEL_SHAPE_FIXED with the holder's source and samples): the facts are the file's,
        so every name of it is planned, served and checked by them."""

        def command() -> list[Aggregate]:
            model: RegisteredModel = self.aggregates.get(RegisteredModel, model_id(name))
            source: RegisteredModel = self.aggregates.get(RegisteredModel, model_id(holder))
            if model.sha256 != source.sha256:
                raise InvalidCommand(f"models {name} and {holder} are different files now")
            shape = getattr(source, "shape", None)
            basis = getattr(source, "shape_from", None)
            if shape is None or basis is None:
                raise InvalidCommand(f"model {holder} has no facts to share")
            fixer_revoked = self._fixer_revoked(model)
            recorded = getattr(source, "samples", None) or {"nonce": "", "samples": []}
            model.adopt_facts(
                dict(shape),
                str(basis),
                str(recorded["nonce"]),
                list(recorded["samples"]),
                fixer_revoked=fixer_revoked,
            )
            return [model]

        return self.aggregates.run(command)

    def model_samples(self, name: str) -> tuple[str, Samples | None]:
        """The sha256 of model ``name``'s file and the samples its facts were recorded with
        (None: none; NotFound: no such model)."""
        model: RegisteredModel = self.aggregates.get(RegisteredModel, model_id(name))
        recorded = getattr(model, "samples", None)
        if not recorded:
            return model.sha256, None
        return model.sha256, Samples.from_event(recorded["nonce"], recorded["samples"])

    def reject_message(
        self, node_id: UUID | str, kind: str, job_id: str, reason: str, suppressed: int = 0
    ) -> int:
        """Records that the node's agent sent a message that was refused (an audit event)."""
        return self.aggregates.change(
            Node, node_id, lambda n: n.reject_message(kind, job_id, reason, suppressed)
        )

    # --------------------------------------------------------- model commands

    def _model_command(self, name: str, act: Callable[[RegisteredModel], object]) -> CommandResult:
        """Runs ``act`` on the registered model ``name`` (NotFound when there is none)."""

        def command() -> list[Aggregate]:
            model = self.aggregates.find(RegisteredModel, model_id(name))
            if model is None:
                raise NotFound("model", name)
            act(model)
            return [model]

        return CommandResult(self.aggregates.run(command), model_id(name))

    def _registered(
        self, name: str, sha256: str, file_name: str, context_size: int, kind: str, pooling: str
    ) -> RegisteredModel:
        """The model ``name`` registered with this file, or its registration updated to it."""
        model = self.aggregates.find(RegisteredModel, model_id(name))
        if model is None:
            return RegisteredModel.register(name, sha256, file_name, context_size, kind, pooling)
        model.update(sha256, file_name, context_size, kind, pooling)
        return model

    def register_model(
        self,
        name: str,
        sha256: str,
        file_name: str,
        context_size: int = DEFAULT_CONTEXT_SIZE,
        kind: str = CHAT,
        pooling: str = "",
    ) -> CommandResult:
        """Registers (or updates) a model's API name; identical re-registration is a no-op."""

        def command() -> list[Aggregate]:
            return [self._registered(name, sha256, file_name, context_size, kind, pooling)]

        return CommandResult(self.aggregates.run(command), model_id(name))

    def add_model_source(self, name: str, url: str) -> CommandResult:
        """MODEL_SOURCE_ADDED: an http(s) URL of the model's file (none for a known one)."""
        return self._model_command(name, lambda model: model.add_source(url))

    def remove_model_source(self, name: str, url: str) -> CommandResult:
        """MODEL_SOURCE_REMOVED."""
        return self._model_command(name, lambda model: model.remove_source(url))

    def store_model(
        self,
        name: str,
        sha256: str,
        file_name: str,
        shape: dict[str, Any],
        context_size: int = DEFAULT_CONTEXT_SIZE,
        kind: str = CHAT,
        pooling: str = "",
    ) -> CommandResult:
        """Registers (or updates) a model whose file the controller's model store now holds,
        and records that (MODEL_STORED, with the file's shape), in one write."""

        def command() -> list[Aggregate]:
            model = self._registered(name, sha256, file_name, context_size, kind, pooling)
            model.store(
                size_bytes=int(shape["size_bytes"]),
                layers=int(shape["layers"]),
                context_length=int(shape["context_length"]),
                kv_bytes_per_token=int(shape["kv_bytes_per_token"]),
                architecture=str(shape["architecture"]),
            )
            return [model]

        return CommandResult(self.aggregates.run(command), model_id(name))

    def unstore_model(self, name: str) -> CommandResult:
        """MODEL_UNSTORED: the controller's model store no longer holds the model's file."""
        return self._model_command(name, lambda model: model.unstore())

    # ----------------------------------------------------------- job commands

    def _new_job(self, submission: Submission, job_id: UUID) -> Job:
        messages = submission.recorded_messages()
        canonical = orjson.dumps(messages, option=orjson.OPT_SORT_KEYS).decode()
        return Job.submit(
            job_id=job_id,
            model=submission.model,
            params=submission.recorded_params(),
            messages=messages if self.record_content else None,
            prompt_sha256=sha256_text(canonical),
            message_count=len(messages),
            stream=submission.stream,
            controller=self.owner,
            key_id=submission.grant.key_id,
        )

    def submit(self, submission: Submission, job_id: UUID | None = None) -> CommandResult:
        new_id = job_id or uuid4()
        return CommandResult(
            self.aggregates.run(lambda: [self._new_job(submission, new_id)]), new_id
        )

    def record_new_jobs(self, new_jobs: Sequence[NewDispatch | NewQueued]) -> int:
        """New jobs in one transaction, all or nothing, their events in the order given: for a
        :class:`NewDispatch` JOB_SUBMITTED, JOB_PLANNED, the plan's NODE_JOB_ASSIGNED and
        JOB_DISPATCHED; for a :class:`NewQueued` JOB_SUBMITTED and JOB_QUEUED. Jobs placed on
        the same node share its aggregate, so their slots add up; a node that cannot take a
        job (another placement took its slot first, here or in another controller) raises a
        domain error and nothing is recorded. The dispatch batcher is the one caller."""

        runs = 0

        def command() -> list[Aggregate]:
            nonlocal runs
            runs += 1
            if runs > 1 and new_jobs and self.aggregates.find(Job, new_jobs[0].job_id) is not None:
                # Run again after a conflict, and the jobs are there: the store took the first
                # try but its answer was lost (the database stopping just after the commit).
                # Their ids are new, and the transaction is all or nothing: nothing is left.
                return []
            changed: dict[UUID, Aggregate] = {}
            for new in new_jobs:
                job = self._new_job(new.submission, new.job_id)
                changed[job.id] = job
                if isinstance(new, NewQueued):
                    job.enqueue(new.position, new.reason)
                    continue
                job.record_plan(new.plan)
                for node in self._assign(
                    job, new.plan, new.roles, new.allow_degraded, changed, new.route
                ):
                    changed[node.id] = node
            return list(changed.values())

        return self.aggregates.run(command)

    def plan_and_dispatch(
        self,
        job_id: UUID | str,
        plan: dict[str, Any],
        roles: Mapping[str, str],
        *,
        allow_degraded: bool = False,
        replan_reason: str | None = None,
        excluded_node: str = "",
        out_of_memory: dict[str, Any] | None = None,
        route: dict[str, Any] | None = None,
    ) -> int:
        """Plans a submitted or queued job (or re-plans one whose setup failed, releasing its
        old nodes) and dispatches it, all or nothing, as :meth:`record_new_jobs` does."""

        def command() -> list[Aggregate]:
            job = self.aggregates.load(Job, job_id)
            changed: dict[UUID, Aggregate] = {job.id: job}
            if replan_reason is None:
                job.record_plan(plan)
            else:
                self._release_nodes(job, changed, outcome="replanned")
                job.replan(plan, replan_reason, excluded_node, out_of_memory)
            for node in self._assign(job, plan, roles, allow_degraded, changed, route):
                changed[node.id] = node
            return list(changed.values())

        return self.aggregates.run(command)

    def _assign(
        self,
        job: Job,
        plan: dict[str, Any],
        roles: Mapping[str, str],
        allow_degraded: bool,
        loaded: Mapping[UUID, Aggregate] | None = None,
        route: dict[str, Any] | None = None,
    ) -> list[Node]:
        """Assigns ``job`` to every node of ``roles``, on the server ``plan`` runs on, and
        records JOB_DISPATCHED (with how the server was chosen: ``route``)."""
        runtime = runtime_of(ExecutionPlan.from_dict(plan))
        nodes = []
        for node_id, role in roles.items():
            existing = (loaded or {}).get(UUID(node_id))
            node = existing if isinstance(existing, Node) else self.aggregates.load(Node, node_id)
            try:
                node.assign_job(str(job.id), role, allow_degraded=allow_degraded, runtime=runtime)
            except IllegalTransition as e:
                raise SlotTaken(str(e)) from e
            nodes.append(node)
        job.dispatch(list(roles), route)
        return nodes

    def release_nodes(self, job_id: UUID | str, outcome: str) -> int:
        """Frees the job's slots on its nodes (before a re-plan places it again)."""

        def command() -> list[Aggregate]:
            job = self.aggregates.load(Job, job_id)
            changed: dict[UUID, Aggregate] = {}
            self._release_nodes(job, changed, outcome=outcome)
            return list(changed.values())

        return self.aggregates.run(command)

    def validate_setup(self, job_id: UUID | str) -> int:
        """Records JOB_SETUP_VALIDATED. A job validated already is left as it is: the write is
        tried again when the store took it but its answer was lost (the database stopping
        just after the commit), and finding it written is the write having succeeded."""

        def validate(job: Job) -> None:
            if job.state not in EXECUTION_PHASE_STATES:
                job.validate_setup()

        return self.aggregates.change(Job, job_id, validate)

    def record_token_chunks(self, chunks: Mapping[Any, Sequence[Delta]]) -> int:
        """Records one TOKEN_STREAM_CHUNK per job for many jobs in one transaction."""

        def command() -> list[Aggregate]:
            jobs: list[Aggregate] = []
            for job_id, deltas in chunks.items():
                if not deltas:
                    continue
                job = self.aggregates.load(Job, job_id)
                job.record_chunk([self._delta_payload(d) for d in deltas])
                jobs.append(job)
            return jobs

        return self.aggregates.run(command)

    def _delta_payload(self, delta: Delta) -> dict[str, Any]:
        payload: dict[str, Any] = {"seq": delta.seq, "tokens": delta.tokens}
        if self.record_content:
            payload["text"] = delta.text
        else:
            payload["sha256"] = sha256_text(delta.text)
            payload["chars"] = len(delta.text)
        return payload

    def complete(
        self, job_id: UUID | str, outcome: JobOutcome, *, chunk: Sequence[Delta] = ()
    ) -> int:
        """Ends the job as completed (JOB_COMPLETED), after ``chunk``, its last deltas not yet
        recorded, in the same transaction (as every ending below)."""

        def act(job: Job) -> None:
            job.complete(
                finish_reason=outcome.finish_reason,
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
                time_to_first_token_ms=outcome.time_to_first_token_ms,
                tokens_per_second=outcome.tokens_per_second,
                cached_prompt_tokens=outcome.cached_prompt_tokens,
            )

        return self._ending(job_id, act, "completed", chunk)

    def fail(
        self, job_id: UUID | str, reason: str, error_code: str = "", *, chunk: Sequence[Delta] = ()
    ) -> int:
        return self._ending(job_id, lambda j: j.fail(reason, error_code), "failed", chunk)

    def reject(
        self, job_id: UUID | str, reason: str, error_code: str, *, chunk: Sequence[Delta] = ()
    ) -> int:
        """Ends the job as the client's error (JOB_REJECTED)."""
        return self._ending(job_id, lambda j: j.reject(reason, error_code), "rejected", chunk)

    def cancel(self, job_id: UUID | str, reason: str, *, chunk: Sequence[Delta] = ()) -> int:
        return self._ending(job_id, lambda j: j.cancel(reason), "cancelled", chunk)

    def _ending(
        self,
        job_id: UUID | str,
        act: Callable[[Job], object],
        outcome: str,
        chunk: Sequence[Delta] = (),
    ) -> int:
        payloads = [self._delta_payload(d) for d in chunk]

        def command() -> list[Aggregate]:
            job = self.aggregates.load(Job, job_id)
            if payloads:
                try:
                    job.record_chunk(payloads)  # its last tokens, then its ending
                except DomainError as e:  # refused before anything changed: the ending decides
                    log.warning("job %s: %d last deltas dropped: %s", job_id, len(payloads), e)
            act(job)
            changed: dict[UUID, Aggregate] = {job.id: job}
            self._release_nodes(job, changed, outcome=outcome)
            return list(changed.values())

        return self.aggregates.run(command)

    def _release_nodes(self, job: Job, changed: dict[UUID, Aggregate], outcome: str) -> None:
        """Releases the job from every node still holding it; finishes pending drains."""
        for node_id in _node_ids(job):
            uid = UUID(node_id)
            existing = changed.get(uid)
            node = existing if isinstance(existing, Node) else self.aggregates.load(Node, uid)
            if str(job.id) in node.jobs:
                node.release_job(str(job.id), outcome)
                node.complete_drain_if_idle()
                changed[uid] = node


@dataclass(frozen=True)
class NewDispatch:
    """A new job with its plan and the role of each plan node (see record_new_jobs)."""

    submission: Submission
    job_id: UUID
    plan: dict[str, Any]
    roles: Mapping[str, str]
    allow_degraded: bool = False
    #: How the server was chosen (JOB_DISPATCHED's ``route``).
    route: dict[str, Any] | None = None


@dataclass(frozen=True)
class NewQueued:
    """A new job that waits in its model's queue at ``position`` (see record_new_jobs)."""

    submission: Submission
    job_id: UUID
    position: int
    reason: str


def _node_ids(job: Job) -> Iterable[str]:
    return list(dict.fromkeys(job.nodes))
