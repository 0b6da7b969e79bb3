"""The agent imports only the standard library, third-party packages, ``agent`` and ``proto``:
none of the controller's layers, so it installs and runs without them."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
CONTROLLER_LAYERS = {"domain", "application", "infrastructure", "interfaces"}


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_agent_module_imports_the_controllers_layers() -> None:
    modules = sorted(AGENT.rglob("*.py"))
    assert len(modules) > 10
    crossing = {p.name: sorted(_imported(p) & CONTROLLER_LAYERS) for p in modules}
    assert {name: layers for name, layers in crossing.items() if layers} == {}
