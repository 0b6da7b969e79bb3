"""The control channel's wire format: ``control.proto`` (``dacp.control.v1``), its generated
modules (``python -m wire.generate``), and the gRPC settings both ends use (keepalive,
verbosity)."""
