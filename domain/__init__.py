"""domain layer of the Distributed AI Compute Platform (see docs/architecture.md, 'Layers')."""
