"""``node-agent`` (``python -m agent.main``) as its own process, the way the security tests
start it: this checkout's code, no ``DACP_*`` settings from the test's environment, no
llama.cpp runtime and no model transfers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def agent_env() -> dict[str, str]:
    """This environment without ``DACP_*``, with this checkout on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DACP_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def agent_command(
    url: str, data_dir: Path, name: str, *extra: str, address: str = "127.0.0.1"
) -> list[str]:
    """The command line of an agent of the controller at ``url`` (``extra`` appended)."""
    return [
        sys.executable,
        "-m",
        "agent.main",
        "--controller-url",
        url,
        "--data-dir",
        str(data_dir),
        "--node-name",
        name,
        "--advertise-address",
        address,
        "--transfer-port",
        "0",
        "--no-runtime",
        *extra,
    ]
