"""The agent's modules stay small enough to read: each holds one responsibility."""

from __future__ import annotations

from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
MAX_LINES = 500


def test_no_agent_module_is_over_500_lines() -> None:
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in AGENT.glob("*.py")}
    assert len(sizes) > 10
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
