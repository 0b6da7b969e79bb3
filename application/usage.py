"""Usage accounting per API key (issue 25): what a usage query asks, and its answer.

A job counts once it has ended (``JOB_COMPLETED``, ``JOB_FAILED``, ``JOB_CANCELLED`` or
``JOB_REJECTED``), at its end time in UTC: one request, with the prompt and completion tokens
its ``JOB_COMPLETED`` recorded (none for a job that ended otherwise). The ``jobs`` view keeps
each job's key id, model, end time and tokens (``application/read_models.py``); a
:class:`~application.ports.UsageReader` sums them by the groups asked for. The admin API
(``GET /api/admin/usage``) and ``dacp usage`` (the store itself, with or without a controller)
answer with :func:`usage_report`. Pure: no clock, no I/O but the reader.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from application.ports import UsageReader
from domain.api_keys import BOOTSTRAP, OPEN
from domain.model import is_model_name

#: What usage can be grouped by: the key, the model, the day (UTC) the job ended.
GROUPS = ("key", "model", "day")
#: The grouping when none is asked for.
DEFAULT_GROUP_BY = ("key", "model")
#: A key id filter is at most this long (printable, no spaces).
MAX_KEY_ID_CHARS = 128
#: What a key filter may hold: a key id (a UUID, ``bootstrap``, ``open``), as the schema says.
KEY_ID_PATTERN = rf"^[A-Za-z0-9._:-]{{0,{MAX_KEY_ID_CHARS}}}$"
#: The names of the keys every cluster knows without a key book.
BUILT_IN_KEY_NAMES = {BOOTSTRAP.key_id: BOOTSTRAP.name, OPEN.key_id: OPEN.name}

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


class UsageQueryError(ValueError):
    """A filter or grouping that cannot be used: ``param`` names it (``key``, ``model``,
    ``from``, ``to`` or ``group_by``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class UsageQuery:
    """Which ended jobs count (all of them when nothing is given) and how they are grouped.
    ``start`` is inclusive and ``end`` exclusive, both UTC."""

    key_id: str | None = None
    model: str | None = None
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    group_by: tuple[str, ...] = DEFAULT_GROUP_BY


def parse_group_by(text: str | None) -> tuple[str, ...]:
    """``key,model,day`` (any of them, in any order) as a tuple in :data:`GROUPS`' order;
    None is :data:`DEFAULT_GROUP_BY`, an empty text no grouping (one row, the totals)."""
    if text is None:
        return DEFAULT_GROUP_BY
    wanted = {part.strip().lower() for part in text.split(",") if part.strip()}
    unknown = sorted(wanted - set(GROUPS))
    if unknown:
        raise UsageQueryError(
            "group_by", f"cannot group by {', '.join(unknown)}: use any of {', '.join(GROUPS)}"
        )
    return tuple(g for g in GROUPS if g in wanted)


def parse_bound(text: str, param: str, *, end: bool) -> dt.datetime:
    """An ISO 8601 date or time as a UTC moment (no zone: UTC). A date alone is its day's
    start; as the end of a range (``end``), the start of the next day, so that the day is in."""
    raw = text.strip()
    try:
        if _DATE.fullmatch(raw):
            day = dt.date.fromisoformat(raw)
            moment = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
            return moment + dt.timedelta(days=1) if end else moment
        if raw.endswith(("Z", "z")):
            raw = raw[:-1] + "+00:00"
        moment = dt.datetime.fromisoformat(raw)
    except (ValueError, OverflowError):
        raise UsageQueryError(
            param,
            f"{param} must be an ISO 8601 date or time (e.g. 2026-01-31 or "
            f"2026-01-31T12:00:00Z), not {text!r}",
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.astimezone(dt.UTC)


def usage_query(
    *,
    key: str | None = None,
    model: str | None = None,
    start: str | None = None,
    end: str | None = None,
    group_by: str | None = None,
) -> UsageQuery:
    """The query the filters describe (an empty key or model filters nothing); a
    :class:`UsageQueryError` names the first that cannot be used."""
    key = key.strip() if key else None
    if key and not re.fullmatch(KEY_ID_PATTERN, key):
        raise UsageQueryError(
            "key",
            f"key must be a key id (at most {MAX_KEY_ID_CHARS} letters, digits, '.', '_', ':' "
            "or '-')",
        )
    model = model.strip() if model else None
    if model and not is_model_name(model):
        raise UsageQueryError("model", f"{model!r} is not a model name")
    # An empty bound is refused like any other that is not a date; a ``to`` before ``from``
    # is an empty range (no jobs), not an error.
    since = parse_bound(start, "from", end=False) if start is not None else None
    until = parse_bound(end, "to", end=True) if end is not None else None
    return UsageQuery(key or None, model or None, since, until, parse_group_by(group_by))


def _iso(moment: dt.datetime | None) -> str | None:
    return moment.astimezone(dt.UTC).isoformat().replace("+00:00", "Z") if moment else None


def _sums(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    requests = prompt = completion = 0
    for row in rows:
        requests += int(row["requests"])
        prompt += int(row["prompt_tokens"])
        completion += int(row["completion_tokens"])
    return {
        "requests": requests,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage_report(reader: UsageReader, query: UsageQuery) -> dict[str, Any]:
    """The answer of ``GET /api/admin/usage`` and ``dacp usage --json``: the query, one row per
    group (``key_id``, ``key_name`` (null where the key is not known), ``model``, ``day``: null
    when not grouped by it) and the totals over all of them."""
    rows = reader.usage(query)
    names = {**BUILT_IN_KEY_NAMES, **reader.key_names()} if "key" in query.group_by else {}
    data = []
    for row in rows:
        item: dict[str, Any] = {"key_id": row.get("key_id")}
        item["key_name"] = names.get(str(row.get("key_id")))
        item["model"] = row.get("model")
        item["day"] = row.get("day")
        item.update(_sums([row]))
        data.append(item)
    return {
        "object": "usage",
        "filters": {
            "key": query.key_id,
            "model": query.model,
            "from": _iso(query.start),
            "to": _iso(query.end),
        },
        "group_by": list(query.group_by),
        "data": data,
        "totals": _sums(rows),
    }
