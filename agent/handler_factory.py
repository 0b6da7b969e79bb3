"""Builds the ControlHandler the agent hands downlink messages to.

For now this is :class:`agent.control_client.NullHandler` (every plan is refused with
"no runtime configured"); the llama.cpp runtime handler plugs in here.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

from agent.control_client import AgentConfig, ControlHandler, NullHandler


def build_handler(config: AgentConfig) -> ControlHandler:
    """The handler for this agent's configuration."""
    del config  # the llama.cpp handler will use llama_bin_dir, models_dir, slots...
    return NullHandler()
