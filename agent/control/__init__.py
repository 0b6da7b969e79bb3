"""The agent's control channel: the session with the controller, its traffic and journal."""
