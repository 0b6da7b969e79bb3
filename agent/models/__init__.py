"""Model files on this node: the local store, fetches, proofs and transfers."""
