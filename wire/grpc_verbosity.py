"""How much gRPC core (the C library under ``grpcio``) prints of its own on stderr, for the
agent and the controller: by default nothing the program reports better itself, such as
``ssl_transport_security.cc`` handshake lines for every failed attempt.

gRPC core reads ``GRPC_VERBOSITY`` once, when ``grpc`` is first imported: each program sets it
before that (the agent in ``agent/grpc_logging.py``, the controller in ``dacp controller``).
An operator's own ``GRPC_VERBOSITY`` or ``GRPC_TRACE`` is left as it is; ``--grpc-debug``
asks for gRPC core's debug output.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Container, MutableMapping

#: The flag both programs take to let gRPC core print its debug output.
GRPC_DEBUG_FLAG = "--grpc-debug"
#: The agent prints nothing of gRPC core's: every failure comes back to it as a status, which
#: it reports in its own words.
AGENT_VERBOSITY = "NONE"
#: The controller keeps gRPC core's errors (a client's failed handshake is logged below them).
CONTROLLER_VERBOSITY = "ERROR"
#: What ``--grpc-debug`` sets.
DEBUG_VERBOSITY = "DEBUG"
#: The variables that say the operator chose gRPC core's output already.
OPERATOR_VARIABLES = ("GRPC_VERBOSITY", "GRPC_TRACE")


def set_grpc_verbosity(
    quiet: str,
    *,
    debug: bool,
    environ: MutableMapping[str, str] = os.environ,
    imported: Container[str] = sys.modules,
) -> str | None:
    """Sets ``GRPC_VERBOSITY`` to ``quiet`` (to :data:`DEBUG_VERBOSITY` with ``debug``) and
    returns it; sets nothing (None) when the operator chose already, or when ``grpc`` is
    imported: it would change nothing here, only what child processes inherit."""
    if "grpc" in imported or any(name in environ for name in OPERATOR_VARIABLES):
        return None
    value = DEBUG_VERBOSITY if debug else quiet
    environ["GRPC_VERBOSITY"] = value
    return value
