"""proto layer of the Distributed AI Compute Platform (see docs/architecture.md,
'Control channel').

``control.proto`` defines the controller <-> node agent control channel; its generated
modules are ``proto.control_pb2`` / ``proto.control_pb2_grpc`` (regenerate with
``python -m proto.generate``).
"""

# The proto package name; bump it (and the package) only for wire-incompatible changes.
PROTOCOL_VERSION = "dacp.control.v1"

# Reserved ``NodeInventory.labels`` keys, part of the wire contract (the proto has no fields):
# the node's capacity in concurrent jobs, and the memory (bytes) the agent offers to the
# scheduler (absent: no limit beyond the hardware).
SLOTS_LABEL = "dacp.slots"
MEMORY_LIMIT_LABEL = "dacp.memory_limit_bytes"

# The largest message either end of the control channel accepts (gRPC's default receive limit).
# A plan carries the whole prompt, so a request whose plan would exceed it is refused before it
# is sent: an oversized message would break the node's stream.
MAX_CONTROL_MESSAGE_BYTES = 4 * 1024 * 1024
# What the controller's gRPC server lets in: larger than the limit, so that an agent message
# between the two is refused alone (MessageRejected) and its stream goes on; only a message
# beyond this one breaks the stream (gRPC's RESOURCE_EXHAUSTED).
CONTROLLER_RECEIVE_BYTES = 4 * MAX_CONTROL_MESSAGE_BYTES

# The name in every certificate the controller issues itself: an agent that pinned the
# controller's CA verifies it under this name, however it reaches it (address, DNS, NAT).
CONTROLLER_TLS_NAME = "dacp-controller"

__all__ = [
    "CONTROLLER_RECEIVE_BYTES",
    "CONTROLLER_TLS_NAME",
    "MAX_CONTROL_MESSAGE_BYTES",
    "MEMORY_LIMIT_LABEL",
    "PROTOCOL_VERSION",
    "SLOTS_LABEL",
]
