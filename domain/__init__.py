"""domain layer of the Distributed AI Compute Platform (see DESIGN.md §2)."""
