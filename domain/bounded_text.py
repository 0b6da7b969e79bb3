"""Text that comes from outside the controller's trust: a node's name, what a caller without
credentials sent, what an agent reports. Before anything records or logs it, it is bounded
(a length limit) and printable (no NUL or other control characters, which a Postgres text
column refuses and a log line should not carry).

A node name is checked, not repaired: a name that breaks the rule is refused, and only its
bounded form is recorded with the refusal.
"""

from __future__ import annotations

#: The longest node name (characters).
NODE_NAME_MAX = 64
#: Punctuation a node name may hold besides letters and digits (host names fit).
NODE_NAME_PUNCTUATION = frozenset("._-")
#: The most characters kept of an identifier (a job, node or transfer id, a sha256, a host,
#: a code) or a short name (an agent version, a GPU model).
ID_MAX = 128
#: The most characters kept of free text (an error message, a reason).
TEXT_MAX = 2048

_ELLIPSIS = "…"
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(ch: str, keep_newlines: bool) -> str:
    if ch.isprintable() or (keep_newlines and ch in "\n\t"):
        return ch
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def bounded(text: str, limit: int = TEXT_MAX, *, keep_newlines: bool = False) -> str:
    """``text`` as it may be recorded or logged: characters that are not printable escaped
    (``\\x00``; newlines and tabs kept only when asked), at most ``limit`` characters of it
    kept, and a cut marked with how much was left out."""
    head = text[: limit + 1]
    if len(text) <= limit and _printable(head, keep_newlines):
        return text
    out: list[str] = []
    size = 0
    for i, ch in enumerate(head):
        piece = _escaped(ch, keep_newlines)
        if size + len(piece) > limit:
            return "".join(out) + f"{_ELLIPSIS}(+{len(text) - i} characters)"
        out.append(piece)
        size += len(piece)
    return "".join(out)


def _printable(text: str, keep_newlines: bool) -> bool:
    if text.isprintable():
        return True
    return keep_newlines and all(ch.isprintable() or ch in "\n\t" for ch in text)


def node_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a node's name, or None: 1 to NODE_NAME_MAX characters, letters
    and digits (any script) and ``.``, ``_``, ``-``, starting with a letter or digit."""
    if not name:
        return "node_name must not be empty"
    rule = (
        f"a node name is 1 to {NODE_NAME_MAX} letters, digits, '.', '_' or '-', starting "
        "with a letter or digit"
    )
    if len(name) > NODE_NAME_MAX:
        return f"node_name is {len(name)} characters long: {rule}"
    for position, ch in enumerate(name):
        allowed = ch.isalnum() or (position > 0 and ch in NODE_NAME_PUNCTUATION)
        if not allowed:
            return f"node_name has {ch!r} at position {position}: {rule}"
    return None
