"""gRPC core prints nothing of its own in the agent unless asked for (``--grpc-debug``, or the
operator's ``GRPC_VERBOSITY``/``GRPC_TRACE``): see ``wire/grpc_verbosity.py``. Import this
before anything imports ``grpc``, which reads the variable once; the flag is read from the
command line here because the arguments are parsed after the imports
(:func:`add_grpc_debug_argument` declares it to ``agent.main``'s parser).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import argparse
import sys

from wire.grpc_verbosity import AGENT_VERBOSITY, GRPC_DEBUG_FLAG, set_grpc_verbosity

set_grpc_verbosity(AGENT_VERBOSITY, debug=GRPC_DEBUG_FLAG in sys.argv[1:])


def add_grpc_debug_argument(parser: argparse.ArgumentParser) -> None:
    """``--grpc-debug``, read above already; declared for ``--help`` and so that it parses."""
    parser.add_argument(
        GRPC_DEBUG_FLAG,
        action="store_true",
        help=(
            "let gRPC core print its own debug output on stderr (by default it prints nothing "
            "unless GRPC_VERBOSITY or GRPC_TRACE is set)"
        ),
    )
