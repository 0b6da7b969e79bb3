"""agent layer of the Distributed AI Compute Platform (see docs/architecture.md, 'Layers')."""

AGENT_VERSION = "0.1.0"

__all__ = ["AGENT_VERSION"]
