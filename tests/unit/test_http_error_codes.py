"""The HTTP layer's error codes are ``interfaces.http.http_errors.ErrorCode``: no handler spells
one as a string, and every member is answered somewhere."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from interfaces.http.http_errors import ErrorCode

HTTP = Path(__file__).resolve().parents[2] / "interfaces" / "http"
#: Calls whose argument at this position (or keyword ``code``) is an error code.
CODE_POSITIONS = {"bad": 2, "error_body": 2, "not_found": 1}


def _strings(node: ast.expr) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):  # f"{kind}_not_found": a code made up as text
        yield ast.unparse(node)
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)


def _code_arguments(tree: ast.AST) -> Iterator[ast.expr]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        yield from (keyword.value for keyword in node.keywords if keyword.arg == "code")
        name = node.func.id if isinstance(node.func, ast.Name) else ""
        position = CODE_POSITIONS.get(name)
        if position is not None and len(node.args) > position:
            yield node.args[position]


def _sources() -> list[tuple[Path, ast.AST]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(HTTP.rglob("*.py"))]


def test_no_handler_spells_an_error_code_as_a_string() -> None:
    spelled = [
        f"{path.relative_to(HTTP)}:{argument.lineno}: {text!r}"
        for path, tree in _sources()
        for argument in _code_arguments(tree)
        for text in _strings(argument)
    ]
    assert spelled == []


def test_every_error_code_is_answered_somewhere() -> None:
    used = {
        node.attr
        for _, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "ErrorCode"
    }
    assert set(ErrorCode.__members__) - used == set()


def test_every_error_code_has_its_own_value() -> None:
    assert len(ErrorCode.__members__) == len({code.value for code in ErrorCode})
