"""``dacp keys create|list|show|change|revoke``: inference API keys for teams, through the
running controller's admin API (``DACP_URL``, ``ADMIN_API_KEY``), as ``dacp models pull`` does.

``create`` prints the key on stdout, once (the controller keeps only its hash: it cannot be
shown again); a key is named by its id or its name. Errors: exit code 2 and one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from application.close_names import suggestion
from interfaces.cli.cli_target import AdminClient, CliError, load_cli_env
from interfaces.cli.events_cli import _emit_json, format_table

PATH = "/api/admin/api-keys"
#: The limits, by flag: (flag, the API's field, what the table shows).
LIMIT_FLAGS = (
    ("--rpm", "requests_per_minute", "rpm"),
    ("--tpm", "tokens_per_minute", "tpm"),
    ("--concurrent", "concurrent_requests", "concurrent"),
    ("--monthly-tokens", "monthly_tokens", "month"),
)
#: What a limit flag, ``--models`` and ``--expires-at`` take to mean "none".
NO_LIMIT, EVERY_MODEL, NEVER = "none", "all", "never"


def _limit(text: str) -> int | None:
    """A limit flag's value: a positive integer, or ``none`` (no limit)."""
    if text.lower() == NO_LIMIT:
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (or {NO_LIMIT})") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a limit is positive (or {NO_LIMIT}), got {value}")
    return value


def _models(text: str) -> list[str] | None:
    """``m1,m2`` (those models), or ``all`` (every model)."""
    if text.lower() == EVERY_MODEL:
        return None
    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models:
        raise argparse.ArgumentTypeError(f"name the models (m1,m2) or {EVERY_MODEL}")
    return models


def _given_limits(args: argparse.Namespace) -> dict[str, int | None]:
    """The limits the flags set (a flag left out is not in it)."""
    out: dict[str, int | None] = {}
    for _, field, _ in LIMIT_FLAGS:
        value = getattr(args, field)
        if value is not _UNSET:
            out[field] = value
    return out


class _Unset:
    def __repr__(self) -> str:
        return "unset"


_UNSET: Any = _Unset()


def _resolve(admin: AdminClient, ident: str) -> dict[str, Any]:
    """The key ``ident`` names: its id, else its name (which must be one key's)."""
    keys: list[dict[str, Any]] = admin.call("GET", PATH, None, 200)["data"]
    by_id = [k for k in keys if k["id"] == ident.lower()]
    if by_id:
        return by_id[0]
    named = [k for k in keys if k["name"] == ident]
    if len(named) == 1:
        return named[0]
    if named:
        ids = ", ".join(k["id"] for k in named)
        raise CliError(f"{len(named)} keys are named {ident}: name one by its id ({ids})")
    names = [str(k["name"]) for k in keys]
    raise CliError(f"no API key named {ident}{suggestion('API key', ident, names)}")


def _state(key: dict[str, Any]) -> str:
    if key.get("revoked"):
        return "revoked"
    return "active" if key.get("active") else "expired"


def _limits_text(limits: dict[str, Any]) -> str:
    parts = [
        f"{short}={limits[field]}"
        for _, field, short in LIMIT_FLAGS
        if limits.get(field) is not None
    ]
    return " ".join(parts) or "none"


def _models_text(models: list[str] | None) -> str:
    return "all" if models is None else ",".join(models)


def _describe(key: dict[str, Any]) -> list[str]:
    """A key's terms, one ``field: value`` line each (``show``, ``change``, ``revoke``)."""
    lines = [
        f"id: {key['id']}",
        f"name: {key['name']}",
        f"owner: {key['owner'] or '-'}",
        f"models: {_models_text(key['models'])}",
        f"limits: {_limits_text(key['limits'])}",
        f"priority: {key['priority']}",
        f"expires: {key['expires_at'] or NEVER}",
        f"created: {key['created_at']}",
        f"state: {_state(key)}",
    ]
    if key.get("revoked"):
        lines.append(f"revoked: {key['revoked_at']} by {key['revoked_by']}: {key['revoke_reason']}")
    return lines


def _show(key: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _emit_json(key)
    else:
        print("\n".join(_describe(key)))


def cmd_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "priority": args.priority}
    if args.owner is not None:
        body["owner"] = args.owner
    if args.models is not None:
        body["models"] = args.models
    limits = {field: value for field, value in _given_limits(args).items() if value is not None}
    if limits:
        body["limits"] = limits
    if args.expires_at is not None:
        body["expires_at"] = args.expires_at
    created = load_cli_env().admin(args.url).call("POST", PATH, body, 201)
    if args.json:
        _emit_json(created)
    else:
        print(created["key"])
    print(
        f"dacp: created API key {created['name']} ({created['id']}); the key above is shown "
        "this once and will not be shown again: store it now",
        file=sys.stderr,
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    keys = load_cli_env().admin(args.url).call("GET", PATH, None, 200)["data"]
    if args.json:
        _emit_json(keys)
        return 0
    rows = [
        [
            str(k["id"]),
            str(k["name"]),
            str(k["owner"] or "-"),
            _models_text(k["models"]),
            _limits_text(k["limits"]),
            str(k["priority"]),
            str(k["expires_at"] or NEVER),
            _state(k),
        ]
        for k in keys
    ]
    headers = ["ID", "NAME", "OWNER", "MODELS", "LIMITS", "PRIORITY", "EXPIRES", "STATE"]
    print("\n".join(format_table(headers, rows)))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    _show(_resolve(load_cli_env().admin(args.url), args.ident), args.json)
    return 0


def cmd_change(args: argparse.Namespace) -> int:
    admin = load_cli_env().admin(args.url)
    key = _resolve(admin, args.ident)
    body: dict[str, Any] = {}
    for field in ("name", "owner", "priority"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    if args.models is not _UNSET:
        body["models"] = args.models
    if args.expires_at is not None:
        body["expires_at"] = None if args.expires_at.lower() == NEVER else args.expires_at
    given = _given_limits(args)
    if given:  # the API replaces all four: the ones not given stay as they are
        body["limits"] = {**key["limits"], **given}
    if not body:
        raise CliError(
            "nothing to change: give --name, --owner, --models, a limit, --priority or --expires-at"
        )
    changed = admin.call("PATCH", f"{PATH}/{key['id']}", body, 200)
    _show(changed, args.json)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    admin = load_cli_env().admin(args.url)
    key = _resolve(admin, args.ident)
    revoked = admin.call("POST", f"{PATH}/{key['id']}/revoke", {"reason": args.reason}, 200)
    if args.json:
        _emit_json(revoked)
        return 0
    print(f"revoked API key {revoked['name']} ({revoked['id']}): it fails from now on")
    return 0


def _common(command: argparse.ArgumentParser, *, json_help: str = "print JSON") -> None:
    command.add_argument("--json", action="store_true", help=json_help)
    command.add_argument(
        "--url",
        default=None,
        help="the controller's HTTP address (default: DACP_URL, from the environment or the "
        "config file); ADMIN_API_KEY is the key",
    )


def _terms(command: argparse.ArgumentParser, *, change: bool) -> None:
    command.add_argument("--owner", default=None, help="who the key is for (a team, a person)")
    command.add_argument(
        "--models",
        type=_models,
        default=_UNSET if change else None,
        help="the models the key may use, m1,m2"
        + (f" ({EVERY_MODEL}: every model)" if change else " (default: every model)"),
    )
    for flag, field, _ in LIMIT_FLAGS:
        command.add_argument(
            flag,
            dest=field,
            type=_limit,
            default=_UNSET,
            metavar="N",
            help=f"{field.replace('_', ' ')} ({NO_LIMIT}: no limit; default: no limit)"
            if not change
            else f"{field.replace('_', ' ')} ({NO_LIMIT}: no limit; left out: unchanged)",
        )
    command.add_argument(
        "--priority",
        choices=("interactive", "batch"),
        default=None if change else "interactive",
        help="the key's class in a model's queue (default: interactive)",
    )
    command.add_argument(
        "--expires-at",
        default=None,
        metavar="ISO",
        help="when the key stops working, ISO 8601 with its zone (2026-12-31T00:00:00Z)"
        + (f"; {NEVER}: no expiry" if change else "; default: never"),
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``keys create|list|show|change|revoke`` to ``dacp``."""
    keys = sub.add_parser("keys", help="inference API keys for teams (via the admin API)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)

    create = keys_sub.add_parser(
        "create", help="create a key; it is printed once and never shown again"
    )
    create.add_argument("name", help="the key's name (a team, an application)")
    _terms(create, change=False)
    _common(create, json_help="print the key and its terms as JSON")
    create.set_defaults(func=cmd_create)

    listing = keys_sub.add_parser("list", help="every key, newest first (never the key itself)")
    _common(listing)
    listing.set_defaults(func=cmd_list)

    show = keys_sub.add_parser("show", help="one key's terms and state")
    show.add_argument("ident", metavar="KEY", help="the key's id or name")
    _common(show)
    show.set_defaults(func=cmd_show)

    change = keys_sub.add_parser("change", help="change a key's terms (the flags given)")
    change.add_argument("ident", metavar="KEY", help="the key's id or name")
    change.add_argument("--name", default=None, help="a new name")
    _terms(change, change=True)
    _common(change)
    change.set_defaults(func=cmd_change)

    revoke = keys_sub.add_parser("revoke", help="revoke a key for good: it fails at once")
    revoke.add_argument("ident", metavar="KEY", help="the key's id or name")
    revoke.add_argument("--reason", default="revoked by an administrator")
    _common(revoke)
    revoke.set_defaults(func=cmd_revoke)
