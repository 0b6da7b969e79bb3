"""``dacp nodes revoke``: revoking a node, written to the event store directly. Every running
controller sees NODE_REVOKED through its projection follower and closes the node's stream."""

from __future__ import annotations

import argparse

from domain.errors import DomainError
from interfaces.events_cli import Refusal, _guarded, _store_option, opened, resolve


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
