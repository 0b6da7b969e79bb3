"""What to suggest for a name nothing answers to: the closest known names (difflib), in one
line, for the messages that refuse an unknown node, model, job or token."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: Most names suggested.
MAX_SUGGESTIONS = 3
#: How alike a name must be to be suggested (difflib's ratio, 0 to 1).
SIMILARITY = 0.6
#: With nothing close, every known name is listed when there are at most this many.
LIST_ALL_UP_TO = 5


def closest_names(ident: str, known: Iterable[str]) -> list[str]:
    """The known names most like ``ident`` (case aside), best first; at most
    :data:`MAX_SUGGESTIONS`."""
    by_folded: dict[str, str] = {}
    for name in known:
        by_folded.setdefault(name.casefold(), name)
    folded = difflib.get_close_matches(
        ident.casefold(), list(by_folded), n=MAX_SUGGESTIONS, cutoff=SIMILARITY
    )
    return [by_folded[f] for f in folded]


def suggestion(kind: str, ident: str, known: Iterable[str]) -> str:
    """What to append to a refusal of the unknown ``kind`` ``ident``: ``; closest known: a,
    b``, else (few known) ``; known: a, b, c``, else (none) ``; no node is known yet``, else
    nothing."""
    names = sorted(set(known))
    close = closest_names(ident, names)
    if close:
        return f"; closest known: {', '.join(close)}"
    if not names:
        return f"; no {kind} is known yet"
    if len(names) <= LIST_ALL_UP_TO:
        return f"; known: {', '.join(names)}"
    return ""
