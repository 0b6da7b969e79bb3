"""``dacp``: the controller's command line (controller, tokens, ...).

Errors end with exit code 2 and one line on stderr; nothing half-done is recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from eventsourcing.persistence import PersistenceError

from application.enrollment import (
    DEFAULT_TOKEN_TTL,
    EnrollmentNotConfigured,
    EnrollmentService,
)
from infrastructure import event_loop
from infrastructure.settings import Settings, SettingsError

if TYPE_CHECKING:
    from application.controller import Controller


class CliError(Exception):
    """A one-line message for the user; exit code 2."""


def _cmd_controller(args: argparse.Namespace) -> int:
    from interfaces.controller_main import serve_forever

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = Settings.from_env()
    if args.insecure:
        settings = dataclasses.replace(settings, insecure=True)
    if args.open_api:
        settings = dataclasses.replace(settings, open_api=True)
    try:
        event_loop.run(serve_forever(settings))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        raise CliError(str(e)) from e
    return 0


def _controller_ca(settings: Settings) -> bytes | None:
    """The CA the controller serves TLS with (created now if it has never started); None with
    GRPC_INSECURE=true."""
    from infrastructure.tls import TlsError, pinned_ca

    if settings.insecure:
        return None
    try:
        return pinned_ca(
            settings.tls_dir, cert_file=settings.tls_cert_file, ca_file=settings.tls_ca_file
        )
    except TlsError as e:
        raise CliError(str(e)) from e


def _cmd_ca_export(args: argparse.Namespace) -> int:
    ca = _controller_ca(Settings.from_env())
    if ca is None:
        raise CliError("GRPC_INSECURE=true: the controller serves no TLS, so it has no CA")
    sys.stdout.write(ca.decode())
    return 0


def _cmd_token_create(args: argparse.Namespace) -> int:
    from infrastructure.tls import fingerprint_of

    settings = Settings.from_env()
    ca = _controller_ca(settings)
    service = EnrollmentService(
        _open_app(args),
        settings.node_enrollment_secret,
        ca_fingerprint=fingerprint_of(ca) if ca is not None else None,
    )
    try:
        # Recorded in the store (ENROLLMENT_TOKEN_MINTED): `dacp token list`/`revoke` see it.
        minted = service.mint(
            ttl_seconds=args.ttl,
            single_use=args.single_use,
            node_name=args.node_name,
            now=time.time(),
            minted_by="cli",
        )
    except EnrollmentNotConfigured as e:
        raise CliError(str(e)) from e
    except ValueError as e:
        raise CliError(str(e)) from e
    finally:
        service.app.close()
    if args.json:
        print(orjson.dumps(minted.__dict__).decode())
    else:
        print(minted.token)
    return 0


def _open_app(args: argparse.Namespace) -> Controller:
    from application.controller import Controller
    from infrastructure.persistence import persistence_env
    from infrastructure.storage import ensure_postgres_schema

    settings = Settings.from_env()
    url = getattr(args, "database_url", None) or settings.database_url
    env = persistence_env(url, var_dir=settings.var_dir)
    ensure_postgres_schema(env)
    return Controller(env=env)


def _cmd_models_register(args: argparse.Namespace) -> int:
    from domain.errors import DomainError

    app = _open_app(args)
    try:
        app.register_model(
            args.name, args.sha256, args.file_name, args.context_size, args.kind, args.pooling
        )
    except DomainError as e:
        raise CliError(str(e)) from e
    finally:
        app.close()
    print(f"registered {args.kind} model {args.name} → {args.file_name} ({args.sha256[:12]}…)")
    return 0


def _admin_post(url: str, path: str, body: dict[str, object], expected: int) -> Any:
    """POSTs to the running controller's admin API (ADMIN_API_KEY; SSL_CERT_FILE over
    HTTPS); the answer's JSON, or a :class:`CliError` with its message."""
    import httpx

    key = os.environ.get("ADMIN_API_KEY", "")
    verify: str | bool = os.environ.get("SSL_CERT_FILE") or True
    try:
        answer = httpx.post(
            f"{url.rstrip('/')}{path}",
            headers={"Authorization": f"Bearer {key}"},
            json=body,
            timeout=60,
            verify=verify,
        )
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach the controller at {url}: {e}") from e
    if answer.status_code != expected:
        try:
            message = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = answer.text[:200]
        raise CliError(f"refused ({answer.status_code}): {message}")
    return answer.json()


def _cmd_models_source(args: argparse.Namespace) -> int:
    from application.errors import NotFound
    from domain.errors import DomainError
    from proto.model_sources import SourceRefused, check_url, parse_cidrs

    if args.action == "add":  # what the admin API checks (nodes check again before a fetch)
        allowed = parse_cidrs(Settings.from_env().model_source_allowed_cidrs)
        try:
            check_url(args.url, allowed)
        except SourceRefused as e:
            raise CliError(f"cannot add the source of {args.name}: {e}") from e
    app = _open_app(args)
    try:
        if args.action == "add":
            app.add_model_source(args.name, args.url)
        else:
            app.remove_model_source(args.name, args.url)
    except (DomainError, NotFound) as e:
        raise CliError(f"cannot {args.action} the source of {args.name}: {e}") from e
    finally:
        app.close()
    verb = "added to" if args.action == "add" else "removed from"
    print(f"{args.url} {verb} the sources of model {args.name}")
    return 0


def _cmd_models_evict(args: argparse.Namespace) -> int:
    gone = _admin_post(
        args.url, "/api/admin/models/evict", {"model": args.name, "node": args.node}, 200
    )
    print(f"deleted {gone['file_name']} from node {args.node}")
    return 0


def _cmd_models_pull(args: argparse.Namespace) -> int:
    """Asks the running controller (its admin API) to have nodes fetch a model."""
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    body: dict[str, object] = {"model": args.name, "nodes": nodes}
    transfers = _admin_post(args.url, "/api/admin/models/pull", body, 202)["transfers"]
    for t in transfers:
        print(
            f"node {t['node_id']} fetches {args.name} from {', '.join(t['sources'])}"
            f" (transfer {t['transfer_id']})"
        )
    if not transfers:
        print(f"every node named holds {args.name} already")
    print("dacp diagnose NODE shows how it goes (MODEL_TRANSFER_*)")
    return 0


def _admin_url_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--url",
        default=os.environ.get("DACP_URL", "http://127.0.0.1:8000"),
        help="the controller's HTTP address (env DACP_URL); ADMIN_API_KEY is the key",
    )


def build_parser() -> argparse.ArgumentParser:
    # events, replay, diagnose, projections; nodes; the model store
    from interfaces import events_cli, nodes_cli, store_cli

    parser = argparse.ArgumentParser(prog="dacp", description="Distributed AI Compute Platform")
    sub = parser.add_subparsers(dest="command", required=True)

    ctl = sub.add_parser("controller", help="run the controller (HTTP + gRPC) in the foreground")
    ctl.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "warning"))
    ctl.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC and plain HTTP (as GRPC_INSECURE=true): only on a trusted network",
    )
    ctl.add_argument(
        "--open-api",
        action="store_true",
        help="serve /v1 without AI_API_KEY on a HOST beyond loopback (as OPEN_API=true): "
        "anyone who reaches it may use the cluster; without it such a controller refuses to start",
    )
    ctl.set_defaults(func=_cmd_controller)

    ca = sub.add_parser("ca", help="the controller's certificate authority")
    ca_sub = ca.add_subparsers(dest="ca_command", required=True)
    export = ca_sub.add_parser(
        "export",
        help="print the CA certificate (PEM) that OpenAI clients trust (SSL_CERT_FILE) and "
        "agents pin",
    )
    export.set_defaults(func=_cmd_ca_export)

    token = sub.add_parser("token", help="enrollment tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="mint a token signed with NODE_ENROLLMENT_SECRET")
    create.add_argument(
        "--ttl",
        type=float,
        default=DEFAULT_TOKEN_TTL,
        help="seconds until it expires (default 1 h, at most 7 days)",
    )
    uses = create.add_mutually_exclusive_group()
    uses.add_argument(
        "--single-use",
        dest="single_use",
        action="store_true",
        default=True,
        help="valid for one enrollment (the default)",
    )
    uses.add_argument(
        "--multi-use",
        dest="single_use",
        action="store_false",
        help="valid for any number of enrollments until it expires (e.g. many synthetic nodes)",
    )
    create.add_argument("--node-name", default=None, help="bind the token to this node name")
    create.add_argument("--json", action="store_true", help="print token details as JSON")
    create.set_defaults(func=_cmd_token_create)
    nodes_cli.register_token_commands(token_sub)
    models = sub.add_parser("models", help="the model registry")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    reg = models_sub.add_parser("register", help="register a model's API name and GGUF file")
    reg.add_argument("name", help="the name clients pass as `model`")
    reg.add_argument("--sha256", required=True, help="sha256 of the GGUF file")
    reg.add_argument("--file-name", required=True, help="the GGUF file name on the agents")
    reg.add_argument("--context-size", type=int, default=2048)
    reg.add_argument(
        "--kind",
        choices=("chat", "embedding"),
        default="chat",
        help="chat (/v1/chat/completions, /v1/completions) or embedding (/v1/embeddings)",
    )
    reg.add_argument(
        "--pooling",
        choices=("mean", "cls", "last"),
        default="",
        help="an embedding model's pooling (default: the model's own)",
    )
    reg.add_argument("--database-url", default=None, help="default: DATABASE_URL or var/")
    reg.set_defaults(func=_cmd_models_register)
    pull = models_sub.add_parser(
        "pull", help="have nodes fetch a model from nodes that hold it (via the admin API)"
    )
    pull.add_argument("name", help="the registered model")
    pull.add_argument("--nodes", required=True, help="comma-separated node names or ids")
    _admin_url_option(pull)
    pull.set_defaults(func=_cmd_models_pull)
    source = models_sub.add_parser(
        "source", help="add or remove an http(s) URL a model's file can be fetched from"
    )
    source.add_argument("action", choices=("add", "remove"))
    source.add_argument("name", help="the registered model")
    source.add_argument("url", help="http(s)://HOST[:PORT]/PATH of the GGUF file")
    source.add_argument("--database-url", default=None, help="default: DATABASE_URL or var/")
    source.set_defaults(func=_cmd_models_source)
    evict = models_sub.add_parser(
        "evict", help="delete a model's file from a node's disk (refused while jobs use it)"
    )
    evict.add_argument("name", help="the registered model")
    evict.add_argument("--node", required=True, help="the node's name or id")
    _admin_url_option(evict)
    evict.set_defaults(func=_cmd_models_evict)

    store_cli.register(models_sub)
    events_cli.register(sub)
    nodes_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, SettingsError) as e:
        print(f"dacp: {e}", file=sys.stderr)
        return 2
    except (PersistenceError, psycopg.Error, sqlite3.Error) as e:
        print(f"dacp: cannot use the event store: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or directory it cannot use
        print(f"dacp: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
