"""What this node is and has: identity, TLS, hardware, devices and its inventory."""
