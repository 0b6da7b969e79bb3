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

__all__ = ["MEMORY_LIMIT_LABEL", "PROTOCOL_VERSION", "SLOTS_LABEL"]
