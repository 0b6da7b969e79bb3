"""The controller's version, reported in /health, Welcome and diagnose output."""

CONTROLLER_VERSION = "0.1.0"
