"""The admin API, /metrics and the operator dashboard."""
