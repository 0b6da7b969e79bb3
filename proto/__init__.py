"""proto layer of the Distributed AI Compute Platform (see DESIGN.md §2).

``control.proto`` defines the controller <-> node agent control channel; its generated
modules are ``proto.control_pb2`` / ``proto.control_pb2_grpc`` (regenerate with
``python -m proto.generate``).
"""

# The proto package name; bump it (and the package) only for wire-incompatible changes.
PROTOCOL_VERSION = "dacp.control.v1"

__all__ = ["PROTOCOL_VERSION"]
