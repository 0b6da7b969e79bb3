"""The contract: what the controller and its agents both hold to, besides the messages
themselves (``wire/control.proto``): the protocol version, reserved labels, message size limits,
job error codes, device kinds, default ports, default peer networks and the controller's TLS
name.

Both programs import it; it imports nothing of theirs (see docs/architecture.md, 'Layers').
"""

from enum import StrEnum
from typing import Final

# The proto package name; bump it (and the package) only for wire-incompatible changes.
PROTOCOL_VERSION = "dacp.control.v1"

# Reserved ``NodeInventory.labels`` keys, part of the wire contract (the proto has no fields):
# the node's capacity in concurrent jobs, and the memory (bytes) the agent offers to the
# scheduler (absent: no limit beyond the hardware).
SLOTS_LABEL = "dacp.slots"
MEMORY_LIMIT_LABEL = "dacp.memory_limit_bytes"
# ... and the port of its model file server (absent: the node serves no model files).
TRANSFER_PORT_LABEL = "dacp.transfer_port"

# The largest message an agent may send (token chunks, results and reports are far smaller).
MAX_CONTROL_MESSAGE_BYTES = 4 * 1024 * 1024
# What the controller's gRPC server lets in: larger than the limit, so that an agent message
# between the two is refused alone (MessageRejected) and its stream goes on; only a message
# beyond this one breaks the stream (gRPC's RESOURCE_EXHAUSTED).
CONTROLLER_RECEIVE_BYTES = 4 * MAX_CONTROL_MESSAGE_BYTES
# What an agent lets in, and so the largest message the controller sends: an execution plan
# carries the whole request, so the HTTP body limit (MAX_REQUEST_BYTES) stays below this by
# PLAN_OVERHEAD_BYTES, and no request can break a node's stream.
AGENT_RECEIVE_BYTES = 64 * 1024 * 1024
PLAN_OVERHEAD_BYTES = 1024 * 1024


class JobErrorCode(StrEnum):
    """Why a job failed on a node: the ``error_code`` of a ``SetupResult``, ``RpcWorkerStatus``
    or ``JobResult`` (the agent sets it, the controller acts on it), and the codes the
    controller records on a job itself (``NODE_LOST`` and the endings below it)."""

    #: The request's prompt does not fit the model's context: the client's error (HTTP 400,
    #: OpenAI's code), not the node's.
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    #: llama-server refused the request as invalid (HTTP 400 there, and here).
    REQUEST_REJECTED = "invalid_request"
    #: A participant's device ran out of memory (llama.cpp's output says so, on any backend):
    #: before the first token the controller re-plans with that device's budget lowered; after
    #: it the client gets HTTP 503 with this code.
    OUT_OF_MEMORY = "out_of_memory"
    #: Setup: the plan's model file is not on the node, or its sha256 differs.
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    SHA256_MISMATCH = "SHA256_MISMATCH"
    #: Setup: an RPC peer of the plan did not answer a TCP connect (the peer's node is blamed).
    RPC_PEER_UNREACHABLE = "RPC_PEER_UNREACHABLE"
    #: Setup: llama-server or ggml-rpc-server did not start, or the node's runtime is busy.
    RUNTIME_START_FAILED = "RUNTIME_START_FAILED"
    RUNTIME_BUSY = "RUNTIME_BUSY"
    #: Setup: the plan is malformed or asks for more than the node offers.
    INVALID_PLAN = "INVALID_PLAN"
    JOB_ALREADY_RUNNING = "JOB_ALREADY_RUNNING"
    #: The agent is stopping and takes no new job.
    AGENT_STOPPING = "AGENT_STOPPING"
    #: Execution: llama-server died, or generation failed otherwise.
    RUNTIME_CRASHED = "RUNTIME_CRASHED"
    GENERATION_FAILED = "GENERATION_FAILED"
    #: The controller cancelled the job.
    CANCELLED = "CANCELLED"
    #: A job the controller resumes after a reconnect that this agent does not run (restarted).
    JOB_LOST = "JOB_LOST"
    #: The controller's own: a setup whose node disconnected before it answered.
    NODE_LOST = "NODE_LOST"

    # The controller's own endings: it records them as a job's ``error_code`` (and tells the
    # client) itself; an agent never sends them.
    #: An executing job whose node went offline, errored, was revoked or stayed away past the
    #: reconnect grace. Another spelling than a setup's ``NODE_LOST``: both are recorded (this
    #: one as the job's error code, that one in a setup failure's reason), so both stay.
    NODE_LOST_IN_EXECUTION = "node_lost"
    #: The agent's result failed without a code of its own.
    EXECUTION_FAILED = "execution_failed"
    #: Setup failed on every plan tried (or the agent's setup failure had no code).
    SETUP_FAILED = "setup_failed"
    #: No plan fits the cluster; the queue wait ran out; the queue is full.
    NO_CAPACITY = "no_capacity"
    QUEUE_TIMEOUT = "queue_timeout"
    QUEUE_FULL = "queue_full"
    #: A deadline of the running job passed: first token, idle stream, the whole request.
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    STREAM_IDLE_TIMEOUT = "stream_idle_timeout"
    REQUEST_TIMEOUT = "request_timeout"
    #: Recording the job's setup failed (not an outage of the store).
    STORE_ERROR = "store_error"
    #: A previous controller process left the job unfinished.
    CONTROLLER_RESTARTED = "controller_restarted"
    #: The controller abandoned the job for a reason of its own (a bug, or its stop).
    INTERNAL = "internal"


# The old names of the codes both ends use most.
CONTEXT_LENGTH_EXCEEDED: Final = JobErrorCode.CONTEXT_LENGTH_EXCEEDED
REQUEST_REJECTED: Final = JobErrorCode.REQUEST_REJECTED
OUT_OF_MEMORY: Final = JobErrorCode.OUT_OF_MEMORY
# The client's errors: such a job ends JOB_REJECTED, never counted against a node.
CLIENT_ERROR_CODES: frozenset[JobErrorCode] = frozenset(
    {JobErrorCode.CONTEXT_LENGTH_EXCEEDED, JobErrorCode.REQUEST_REJECTED}
)

# Device kinds (Device.kind in inventories) and the host's CPU as llama.cpp names it (its
# buffer type, ``ggml-rpc-server -d CPU``): the agent lists it last among its devices, and the
# controller plans a node's host memory under that name.
DEVICE_GPU = "gpu"
DEVICE_CPU = "cpu"
HOST_DEVICE = "CPU"

MIB = 1 << 20
#: llama-server's host-memory prompt cache at most (``--cache-ram``): llama.cpp's default, and
#: the most an agent gives a server it starts (agent/runtime/server_spec.py:
#: prompt_cache_mib); the controller's prefix index counts a server's cache up to it.
PROMPT_CACHE_BYTES = 8192 * MIB

# Addresses a node may have and RPC peers may come from, unless the operator says otherwise
# (ALLOWED_PEER_CIDRS on the controller, --allowed-peer-cidrs on an agent): private, loopback
# and unique-local ranges.
DEFAULT_ALLOWED_PEER_CIDRS: tuple[str, ...] = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "127.0.0.0/8",
    "::1/128",
    "fc00::/7",
)

# Default ports. The controller's: its HTTP API (PORT), its gRPC control channel (GRPC_PORT,
# where agents connect) and its model store (MODEL_STORE_PORT). An agent's: its
# ``ggml-rpc-server`` (--rpc-port, also the controller's RPC_PORT for a node that reports none)
# and its model file server (--transfer-port).
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 50051
DEFAULT_RPC_PORT = 50052
DEFAULT_TRANSFER_PORT = 50053
DEFAULT_MODEL_STORE_PORT = 50054

# The name in every certificate the controller issues itself: an agent that pinned the
# controller's CA verifies it under this name, however it reaches it (address, DNS, NAT).
CONTROLLER_TLS_NAME = "dacp-controller"

__all__ = [
    "AGENT_RECEIVE_BYTES",
    "CLIENT_ERROR_CODES",
    "CONTEXT_LENGTH_EXCEEDED",
    "CONTROLLER_RECEIVE_BYTES",
    "CONTROLLER_TLS_NAME",
    "DEFAULT_ALLOWED_PEER_CIDRS",
    "DEFAULT_GRPC_PORT",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_MODEL_STORE_PORT",
    "DEFAULT_RPC_PORT",
    "DEFAULT_TRANSFER_PORT",
    "MAX_CONTROL_MESSAGE_BYTES",
    "MEMORY_LIMIT_LABEL",
    "MIB",
    "OUT_OF_MEMORY",
    "PLAN_OVERHEAD_BYTES",
    "PROMPT_CACHE_BYTES",
    "PROTOCOL_VERSION",
    "REQUEST_REJECTED",
    "SLOTS_LABEL",
    "TRANSFER_PORT_LABEL",
    "Endpoint",
    "JobErrorCode",
]


class Endpoint(StrEnum):
    """Which OpenAI endpoint a job serves: what the controller validated the request as, and
    what the agent asks its ``llama-server`` for (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/embeddings``)."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
