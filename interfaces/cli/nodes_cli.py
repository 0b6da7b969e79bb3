"""``dacp nodes revoke`` and ``dacp token list|revoke``: revoking nodes and enrollment tokens,
through the running controller's admin API (``DACP_URL``), or with ``--store`` written to the
event store directly: every running controller sees NODE_REVOKED through its projection
follower and closes the node's stream; a revoked token enrolls nobody."""

from __future__ import annotations

import argparse
import time

from application.close_names import suggestion
from application.errors import NotFound
from domain.errors import DomainError
from domain.times import iso_time
from interfaces.cli.cli_target import load_cli_env, store_flag
from interfaces.cli.events_cli import (
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
    if not args.store:
        admin = load_cli_env().admin()
        nodes = admin.call("GET", "/api/admin/nodes", None, 200)["data"]
        match = [n for n in nodes if args.ident in (n["node_id"], n["name"])]
        if not match:
            names = [str(n["name"]) for n in nodes]
            raise Refusal(f"no node named {args.ident}{suggestion('node', args.ident, names)}")
        node_id = match[0]["node_id"]
        body = {"reason": args.reason}
        row = admin.call("POST", f"/api/admin/nodes/{node_id}/revoke", body, 200)
        print(f"revoked node {row['name']} ({node_id}): its credential no longer works")
        return 0
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
            iso_time(float(r["expires_at"])),
            str(r["minted_by"]),
            "single" if r["single_use"] else "multi",
            str(r["node_name"] or "-"),
            "revoked" if r["revoked"] else ("expired" if r["expires_at"] <= now else "valid"),
        ]
        for r in rows
    ]
    headers = ["TOKEN", "MINTED", "EXPIRES", "BY", "USE", "NODE", "STATE"]
    print("\n".join(format_table(headers, table)))
    return 0


@_guarded
def cmd_token_revoke(args: argparse.Namespace) -> int:
    if not args.store:
        path = f"/api/admin/enrollment-tokens/{args.token_id}/revoke"
        load_cli_env().admin().call("POST", path, None, 200)
        print(f"revoked enrollment token {args.token_id}: it enrolls nobody from now on")
        return 0
    with opened(args) as storage:
        try:
            storage.app.revoke_token(args.token_id, "cli", args.reason)
        except NotFound:
            ids = [str(t["token_id"]) for t in storage.read_model.list_tokens(1000)]
            hint = suggestion("enrollment token", args.token_id, ids)
            raise Refusal(f"unknown enrollment token {args.token_id}{hint}") from None
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
    store_flag(revoke)
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
    store_flag(revoke)
    _store_option(revoke)
    revoke.set_defaults(func=cmd_nodes_revoke)
