"""Ports the application needs from the outside world; adapters live in ``infrastructure``
and ``interfaces``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from application.agent_messages import Rejection
from application.commands import FetchRequest, JobInput, JobParams, Prompt
from application.rate_limits import LimitDecision
from domain.api_keys import Grant

if TYPE_CHECKING:
    from application.usage import UsageQuery


@dataclass(frozen=True)
class LiveNode:
    """What the latest heartbeat said about a node. Not an event: it changes constantly."""

    node_id: str
    last_seen: float  # unix time of the last heartbeat the controller received
    telemetry: dict[str, Any] = field(default_factory=dict)
    connected: bool = True


class LiveState(Protocol):
    """Last-seen times and telemetry per node: held in process, so that recording a heartbeat
    is quick enough for the event loop; shared through Redis when configured."""

    def record_heartbeat(self, node_id: str, telemetry: dict[str, Any], at: float) -> None: ...

    def mark_connected(self, node_id: str, connected: bool, at: float) -> None: ...

    def get(self, node_id: str) -> LiveNode | None: ...

    def all(self) -> dict[str, LiveNode]: ...

    def ping(self) -> bool:
        """Whether the shared store (if any) answers; may do network I/O."""
        ...

    def local_only(self) -> bool:
        """True while a configured shared store is unreachable, so this process keeps the
        heartbeats it receives to itself (no I/O: the last write's outcome)."""
        ...

    def renew_lease(self, owner: str, ttl: float) -> None:
        """Says controller ``owner`` is alive for ``ttl`` more seconds (may do I/O)."""
        ...

    def live_owners(self) -> set[str]:
        """The controllers whose lease has not run out (may do I/O; raises when it cannot
        tell, so that nobody's jobs are taken for orphans on a guess)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RpcPeer:
    node_id: str
    host: str
    port: int


#: Signs a transfer ticket (common/transfer_ticket.py) for (subject, fetching node id): the
#: subject is a model's sha256, or common/link_probe.py PROBE_SUBJECT for a link probe.
TicketSigner = Callable[[str, str], str]


@dataclass(frozen=True)
class LinkPeer:
    """A peer whose link a node measures (``LinkPeer``): its model file server and the
    ticket that lets the node probe it."""

    node_id: str
    host: str
    port: int
    ticket: str


@dataclass(frozen=True)
class LinkProbeRequest:
    """What ``ProbeLinks`` asks a node to measure (application/link_probes.py)."""

    probe_id: str
    peers: tuple[LinkPeer, ...]
    probe_bytes: int


@dataclass(frozen=True, order=True)
class AllowedPeer:
    """A primary that may reach an RPC worker: its node, and the address it connects from."""

    node_id: str
    address: str


@dataclass(frozen=True)
class AssignedDevice:
    """One device of the primary's plan: its node and name there, where the primary reaches
    it ("" for its own device, else the RPC worker's ``host:port``), and its share."""

    node_id: str
    device: str
    endpoint: str
    share: float
    assigned_bytes: int


@dataclass(frozen=True)
class PrimaryAssignment:
    """What the primary of a plan needs to set up and run a job."""

    job_id: str
    model_name: str
    model_file_name: str
    model_sha256: str
    #: Context of each slot; the server holds ``context_size * parallel`` tokens in all.
    context_size: int
    #: llama-server slots (``--parallel``) of the server this job runs on.
    parallel: int
    rpc_peers: tuple[RpcPeer, ...]
    tensor_split: tuple[float, ...]
    #: What the job runs on: a chat's messages, a completion's prompt or embeddings' inputs.
    prompt: JobInput
    #: Its options, ``max_tokens`` capped to a slot's context.
    params: JobParams
    #: An embedding model's server (``--embeddings``) and its pooling ("": the model's own).
    embeddings: bool = False
    pooling: str = ""
    #: The devices the layers go to, in ``--device`` order (empty: a plan without devices).
    devices: tuple[AssignedDevice, ...] = ()
    #: ``--n-gpu-layers`` (None: all layers on the devices).
    n_gpu_layers: int | None = None
    #: The host memory the plan gives the primary's server (``ExecutionPlan.primary_host_bytes``).
    host_bytes: int = 0


class AgentGateway(Protocol):
    """Sends control messages down to connected agents; each returns False when the node
    has no open stream."""

    def is_connected(self, node_id: str) -> bool: ...

    def start_rpc_worker(
        self,
        node_id: str,
        job_id: str,
        host: str,
        port: int,
        allowed: tuple[AllowedPeer, ...],
        devices: tuple[str, ...] = (),
    ) -> bool:
        """Starts the node's RPC worker on ``host:port`` exposing ``devices`` (its names for
        them; empty: its default); exactly ``allowed`` may reach it from now on (the set
        replaces the one before; connections open from others are closed)."""
        ...

    def rpc_worker_peers(self, node_id: str, allowed: tuple[AllowedPeer, ...], reason: str) -> bool:
        """Exactly ``allowed`` may open a connection to the node's RPC worker from now on (a job
        using it ended; open connections stay)."""
        ...

    def fetch_model(self, node_id: str, request: FetchRequest) -> bool:
        """Asks the node to fetch a model file (``FetchModel``)."""
        ...

    def evict_model(self, node_id: str, sha256: str) -> bool:
        """Asks the node to delete a model file (``EvictModel``)."""
        ...

    def stop_rpc_worker(self, node_id: str, reason: str) -> bool:
        """Stops the node's RPC worker: no runtime needs it any more."""
        ...

    def stop_server(self, node_id: str, reason: str) -> bool:
        """Stops the node's llama-server (``StopServer``): its runtime was retired idle."""
        ...

    def probe_links(self, node_id: str, request: LinkProbeRequest) -> bool:
        """Asks the node to measure its links to peers (``ProbeLinks``)."""
        ...

    def assign_primary(self, node_id: str, assignment: PrimaryAssignment) -> bool: ...

    def cancel_job(self, node_id: str, job_id: str, reason: str) -> bool: ...

    def drain(self, node_id: str) -> bool:
        """Tells the node its drain was requested (``Drain``): it takes no new work."""
        ...

    def resume(self, node_id: str) -> bool:
        """Tells the node it accepts work again (``Resume``)."""
        ...

    def revoke(self, node_id: str) -> bool:
        """Ends the revoked node's stream from this side and tells every other connected node
        (``NodesRevoked``: their model file servers refuse it from now on); True when the
        node had a stream here."""
        ...


#: What an uplink handler receives from agents: the adapter's own message type (protobuf for
#: the control channel's servicer).
MessageT = TypeVar("MessageT", contravariant=True)


class UplinkHandler(Protocol[MessageT]):
    """Receives the job-related messages agents send up: what the control channel's servicer
    calls (``interfaces/grpc/agent_bridge.py: JobUplink`` turns them into the job manager's
    typed messages)."""

    async def on_agent_message(self, node_id: str, message: MessageT) -> Rejection | None: ...

    async def on_node_disconnected(self, node_id: str) -> None: ...

    async def on_node_gone(self, node_id: str, reason: str = "") -> None:
        """The node is lost for good (``reason``: why its agent stopped, when it said so)."""

    async def messages_handled(self) -> None:
        """Returns once the messages handed over so far are handled (or gave up waiting)."""

    def resumed_jobs(self, node_id: str) -> list[tuple[str, int]]: ...


class ModelRows(Protocol):
    """The registered models' rows held in memory (``infrastructure/node_rows.py``), kept by
    the projection follower: cheap enough to read on the event loop, on every request."""

    def get_model(self, name: str) -> dict[str, Any] | None:
        """The row of model ``name`` (shared: read it, never change it), or None."""
        ...


class ReadModel(Protocol):
    """The query port over the projections (``application/read_models.py``), implemented in
    ``infrastructure``."""

    def get_node(self, node_id: str) -> dict[str, Any] | None: ...

    def list_nodes(self) -> list[dict[str, Any]]: ...

    def get_job(self, job_id: str) -> dict[str, Any] | None: ...

    def list_jobs(
        self,
        *,
        state: str | None = None,
        model: str | None = None,
        node_id: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[dict[str, Any]]: ...

    def job_ids_starting(self, prefix: str, limit: int = 10) -> list[str]:
        """The ids of the jobs whose (dashed) id begins with ``prefix``, at most ``limit``."""
        ...

    def eligibility(self) -> list[dict[str, Any]]: ...

    def get_model(self, name: str) -> dict[str, Any] | None: ...

    def list_models(self) -> list[dict[str, Any]]: ...


class ApiKeyViews(Protocol):
    """The ``api_keys`` rows (``application/read_models.py: project_api_key``; never a key's
    hash), implemented with the other views in ``infrastructure``."""

    def list_api_keys(self) -> list[dict[str, Any]]:
        """Every managed key, newest first."""
        ...

    def get_api_key(self, key_id: str) -> dict[str, Any] | None: ...


class UsageReader(Protocol):
    """Usage per API key: sums over the ``jobs`` view (``application/usage.py`` says what
    counts), implemented with the other views in ``infrastructure``."""

    def usage(self, query: UsageQuery) -> list[dict[str, Any]]:
        """One row per group of ``query.group_by`` that has an ended job: ``key_id``,
        ``model``, ``day`` (each only when grouped by it), ``requests``, ``prompt_tokens`` and
        ``completion_tokens``, ordered by the groups."""
        ...

    def key_names(self) -> dict[str, str]:
        """The names of the managed keys, by key id (none while there is no key book)."""
        ...


class ModelFetcher(Protocol):
    """Fetches a model onto a node that could then run its jobs
    (:class:`application.model_transfers.TransferCoordinator`)."""

    def fetch_for(self, model: dict[str, Any]) -> bool:
        """Whether such a fetch is under way or starts now (jobs then wait for it)."""
        ...

    def fetch_replica(self, model: dict[str, Any]) -> bool:
        """Whether a fetch is under way, or starts now, onto a node that could then run the
        model's jobs alone: a replica, for the load a split is serving meanwhile."""
        ...


class PromptCounter(Protocol):
    """Counts a prompt's tokens as the model's own server will (chat template, tokenizer).

    ``count`` answers for the model file with ``sha256``: an upper bound on the prompt's
    tokens that is exact whenever it reaches ``limit`` (a short prompt is not tokenized at
    all), or None when this counter cannot count for that file (it does not hold the file,
    or cannot reproduce its tokenizer or template).
    """

    async def count(self, sha256: str, prompt: Prompt, limit: int) -> int | None: ...

    async def prepare(self, sha256: str) -> None:
        """Reads what counting for the file needs ahead of its first request."""
        ...


class Metrics(Protocol):
    """Latency observations the application makes on its hot paths (Prometheus adapter)."""

    def observe_time_to_first_token(self, seconds: float) -> None: ...

    def observe_inter_token(self, seconds: float) -> None:
        """Called on the event loop's thread only (the relay), for every token message."""
        ...

    def observe_append(self, seconds: float) -> None: ...

    def observe_queue_wait(self, seconds: float) -> None: ...

    def count_prefix_route(self, result: str) -> None:
        """A job dispatched to a server chosen by its prompt prefix (a re-planned job again):
        ``result`` is the route's ``"hit"`` or ``"miss"``."""
        ...

    def count_prompt_tokens(self, prompt: int, cached: int) -> None:
        """A completed job's prompt tokens, and of them those llama-server took from its
        cache rather than evaluated again."""
        ...


class NullMetrics:
    def observe_time_to_first_token(self, seconds: float) -> None:
        pass

    def observe_inter_token(self, seconds: float) -> None:
        pass

    def observe_append(self, seconds: float) -> None:
        pass

    def observe_queue_wait(self, seconds: float) -> None:
        pass

    def count_prefix_route(self, result: str) -> None:
        pass

    def count_prompt_tokens(self, prompt: int, cached: int) -> None:
        pass


class RateLimiter(Protocol):
    """A key's limits (``application/rate_limits.py`` states the rule), held where every
    controller sharing them sees the same counters. ``now`` is unix time (the month is UTC's).
    Only grants with a limit are passed (``rate_limits.limited``)."""

    async def acquire(self, grant: Grant, now: float) -> LimitDecision:
        """One atomic check of requests/minute, tokens/minute (not in debt), concurrency and
        the monthly budget; when all allow, the request is counted and its concurrency lease
        taken (``LimitDecision.lease``). Nothing is counted for a refused request."""
        ...

    async def settle(
        self,
        grant: Grant,
        lease: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        now: float,
    ) -> None:
        """Charges what an admitted request's job used to tokens/minute and the month, and
        releases its lease; called exactly once however the job ended."""
        ...

    async def close(self) -> None: ...
