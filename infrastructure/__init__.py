"""infrastructure layer of the Distributed AI Compute Platform.

See docs/architecture.md, 'Layers'.
"""
