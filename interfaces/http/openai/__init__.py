"""The OpenAI-compatible API: validation, the endpoints, the answers."""
