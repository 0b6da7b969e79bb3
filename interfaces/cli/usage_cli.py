"""``dacp usage``: requests and tokens per API key and model, read from the store's read-model
views directly, so that it answers whether or not a controller runs (the numbers of
``GET /api/admin/usage``; ``application/usage.py`` says what counts).

It reads the store as ``dacp events`` does (``--database-url``, else ``DATABASE_URL``, else the
SQLite file under ``DACP_VAR_DIR``): a table, or ``--json``. Errors end with exit code 2 and one
line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from application.usage import UsageQueryError, usage_query, usage_report
from infrastructure.read_model_store import open_read_model
from interfaces.cli.cli_target import CliError
from interfaces.cli.events_cli import Refusal, format_table, store_env

#: The command's flag for each parameter a usage query can refuse.
_FLAGS = {"key": "--key", "model": "--model", "from": "--from", "to": "--to", "group_by": "--by"}


def usage_table(report: Mapping[str, Any]) -> list[str]:
    """The report's rows as a table, with the groups it has and a last line of totals."""
    groups = list(report["group_by"])
    headers = [
        *(["KEY", "NAME"] if "key" in groups else []),
        *(["MODEL"] if "model" in groups else []),
        *(["DAY (UTC)"] if "day" in groups else []),
        "REQUESTS",
        "PROMPT",
        "COMPLETION",
        "TOTAL",
    ]

    def cells(row: Mapping[str, Any], labels: Sequence[str]) -> list[str]:
        counts = ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
        return [*labels, *(str(row[c]) for c in counts)]

    rows = []
    for row in report["data"]:
        labels = [
            *([row["key_id"] or "(none)", row.get("key_name") or ""] if "key" in groups else []),
            *([str(row["model"])] if "model" in groups else []),
            *([str(row["day"])] if "day" in groups else []),
        ]
        rows.append(cells(row, labels))
    blank = ["" for _ in range(len(headers) - 4)]
    if blank:
        blank[0] = "TOTAL"
    rows.append(cells(report["totals"], blank))
    return format_table(headers, rows)


def cmd_usage(args: argparse.Namespace) -> int:
    try:
        query = usage_query(
            key=args.key, model=args.model, start=args.start, end=args.end, group_by=args.by
        )
    except UsageQueryError as e:
        raise CliError(f"{_FLAGS[e.param]}: {e.message}") from e
    try:
        env = store_env(args.database_url)
    except Refusal as e:
        raise CliError(str(e)) from e
    views = open_read_model(env)
    try:
        report = usage_report(views, query)
    finally:
        factory = getattr(views, "factory", None)
        if factory is not None:
            factory.close()
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print("\n".join(usage_table(report)))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``usage`` to ``dacp``."""
    usage = sub.add_parser(
        "usage",
        help="requests and tokens per API key and model (from the store: no controller needed)",
        description="Jobs that ended, by the time they ended (UTC): their requests and the "
        "prompt and completion tokens of those that completed.",
    )
    usage.add_argument("--key", default=None, help="only this key id")
    usage.add_argument("--model", default=None, help="only this model")
    usage.add_argument(
        "--from",
        dest="start",
        default=None,
        help="jobs that ended at or after this ISO 8601 date or time (UTC unless it says)",
    )
    usage.add_argument(
        "--to",
        dest="end",
        default=None,
        help="jobs that ended before this time; a date alone includes that whole day",
    )
    usage.add_argument(
        "--by",
        default=None,
        help="group by any of key,model,day (comma-separated; default key,model; '' for the "
        "totals alone)",
    )
    usage.add_argument("--json", action="store_true", help="print the report as JSON")
    usage.add_argument(
        "--database-url",
        default=None,
        help="event store URL (default: DATABASE_URL, else the SQLite file under var/)",
    )
    usage.set_defaults(func=cmd_usage)
