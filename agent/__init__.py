"""agent layer of the Distributed AI Compute Platform (see DESIGN.md §2)."""

AGENT_VERSION = "0.1.0"

__all__ = ["AGENT_VERSION"]
