"""``dacp nodes revoke`` and ``dacp token list|revoke``: revoking nodes and enrollment tokens,
written to the event store directly. Every running controller sees NODE_REVOKED through its
projection follower and closes the node's stream; a revoked token enrolls nobody."""

from __future__ import annotations

import argparse
import time

from application.errors import NotFound
from domain.errors import DomainError
from interfaces.events_cli import (
    Refusal,
    _emit_json,
    _guarded,
    _store_option,
    format_table,
    opened,
    resolve,
)


@_guarded
def cmd_nodes_revoke(args: argparse.Namespace) -> int:
    with opened(args) as storage:
        node_id = resolve(storage, args.ident, "node")
        try:
            storage.app.revoke_node(node_id, args.reason, "cli")
        except DomainError as e:
            raise Refusal(f"cannot revoke {args.ident}: {e}") from None
        name = storage.app.get_node(node_id).name
    print(f"revoked node {name} ({node_id}): its credential no longer works")
    return 0


@_guarded
def cmd_token_list(args: argparse.Namespace) -> int:
    with opened(args) as storage:
        rows = storage.read_model.list_tokens(args.limit)
    if args.json:
        _emit_json(rows)
        return 0
    now = time.time()
    table = [
        [
            str(r["token_id"]),
            str(r["minted_at"])[:19],
            str(r["minted_by"]),
            "single" if r["single_use"] else "multi",
            str(r["node_name"] or "-"),
            "revoked" if r["revoked"] else ("expired" if r["expires_at"] <= now else "valid"),
        ]
        for r in rows
    ]
    print("\n".join(format_table(["TOKEN", "MINTED", "BY", "USE", "NODE", "STATE"], table)))
    return 0


@_guarded
def cmd_token_revoke(args: argparse.Namespace) -> int:
    with opened(args) as storage:
        try:
            storage.app.revoke_token(args.token_id, "cli", args.reason)
        except NotFound:
            raise Refusal(f"unknown enrollment token {args.token_id}") from None
        except DomainError as e:
            raise Refusal(f"cannot revoke {args.token_id}: {e}") from None
    print(f"revoked enrollment token {args.token_id}: it enrolls nobody from now on")
    return 0


def register_token_commands(token_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``list`` and ``revoke`` to ``dacp token``."""
    listing = token_sub.add_parser("list", help="tokens minted through dacp, newest first")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--json", action="store_true")
    _store_option(listing)
    listing.set_defaults(func=cmd_token_list)
    revoke = token_sub.add_parser("revoke", help="no enrollment with this token from now on")
    revoke.add_argument("token_id", metavar="TOKEN_ID")
    revoke.add_argument("--reason", default="revoked by an administrator")
    _store_option(revoke)
    revoke.set_defaults(func=cmd_token_revoke)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``nodes revoke`` to ``dacp``."""
    nodes = sub.add_parser("nodes", help="enrolled nodes")
    nodes_sub = nodes.add_subparsers(dest="nodes_command", required=True)
    revoke = nodes_sub.add_parser(
        "revoke", help="void a node's credential for good, close its stream, fail its jobs"
    )
    revoke.add_argument("ident", metavar="NODE", help="NODE_ID or node name")
    revoke.add_argument("--reason", default="revoked by an administrator")
    _store_option(revoke)
    revoke.set_defaults(func=cmd_nodes_revoke)
