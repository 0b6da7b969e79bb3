"""The llama.cpp runtime: llama-server and RPC workers, their plans, gates and errors."""
