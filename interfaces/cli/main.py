"""``dacp``: the controller's command line (controller, tokens, ...).

Errors end with exit code 2 and one line on stderr; nothing half-done is recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import os
import secrets
import sqlite3
import sys
import time
from collections.abc import Sequence

import orjson
import psycopg
from eventsourcing.persistence import PersistenceError

from application.enrollment import (
    DEFAULT_TOKEN_TTL,
    EnrollmentNotConfigured,
    EnrollmentService,
)
from common import event_loop
from infrastructure.settings import Settings, SettingsError
from interfaces.cli.cli_target import (
    CliEnv,
    CliError,
    load_cli_env,
    open_app,
    store_flag,
    take_used,
)


@dataclasses.dataclass(frozen=True)
class FirstStart:
    """A controller starting with no config file: the values it starts with (its admin key and
    enrollment secret generated when the environment has none), written into the file once it
    is up (a controller that fails to start writes nothing)."""

    values: dict[str, str]
    generated: tuple[str, ...]


def _first_start(env: CliEnv) -> FirstStart | None:
    if env.configuration.file is not None:
        return None
    values = dict(env.values)
    generated = tuple(k for k in ("ADMIN_API_KEY", "NODE_ENROLLMENT_SECRET") if not values.get(k))
    for secret in generated:
        values[secret] = secrets.token_urlsafe(32)
    return FirstStart(values, generated)


def _write_config(env: CliEnv, first: FirstStart, settings: Settings, http_port: int) -> None:
    """Writes the config file every dacp command reads: the controller's address (DACP_URL),
    state directory, store, ports, admin key and enrollment secret. Never rewritten."""
    from infrastructure.config_file import FIRST_START_KEYS, URL_ENV, write_new
    from infrastructure.tls import is_loopback

    values = dict(first.values)
    values["DACP_VAR_DIR"] = str(settings.var_dir.absolute())
    if not values.get(URL_ENV):
        https = not settings.insecure and not is_loopback(settings.host)
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "", "localhost") else settings.host
        host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
        values[URL_ENV] = f"{'https' if https else 'http'}://{host}:{http_port}"
    written = {k: values[k] for k in FIRST_START_KEYS if values.get(k)}
    path = env.configuration.path
    try:
        wrote = write_new(path, written, dt.datetime.now(dt.UTC))
    except OSError as e:
        env.say(
            f"cannot write the config file {path} ({e.strerror or e}): dacp commands in "
            "other shells need this controller's environment"
        )
        return
    if wrote:
        env.say(
            f"first start: wrote {path} (mode 0600); every dacp command reads it"
            + (f"; generated {' and '.join(first.generated)} there" if first.generated else "")
        )


def _cmd_controller(args: argparse.Namespace) -> int:
    from wire.grpc_verbosity import CONTROLLER_VERBOSITY, set_grpc_verbosity

    set_grpc_verbosity(CONTROLLER_VERBOSITY, debug=args.grpc_debug)  # before grpc is imported
    from interfaces.controller_main import RunningController, serve_forever

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    env = load_cli_env()
    first = _first_start(env)
    settings = Settings.from_env(first.values if first else env.values)
    if args.insecure:
        settings = dataclasses.replace(settings, insecure=True)
    if args.open_api:
        settings = dataclasses.replace(settings, open_api=True)

    def up(running: RunningController) -> None:
        if first is not None:
            _write_config(env, first, settings, running.http_port)
        env.say(f"event store: {env.store_label()}; config: {env.configuration.path}")

    try:
        event_loop.run(serve_forever(settings, on_up=up))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        raise CliError(str(e)) from e
    return 0


def _controller_ca(settings: Settings) -> bytes | None:
    """The CA the controller serves TLS with (never created here: only a controller creates
    its CA); None with GRPC_INSECURE=true."""
    from infrastructure.tls import TlsError, pinned_ca

    if settings.insecure:
        return None
    try:
        return pinned_ca(
            settings.tls_dir,
            cert_file=settings.tls_cert_file,
            ca_file=settings.tls_ca_file,
            create=False,
        )
    except TlsError as e:
        raise CliError(str(e)) from e


def _cmd_ca_export(args: argparse.Namespace) -> int:
    env = load_cli_env()
    env.say(f"the CA of the controller in {env.settings().var_dir}")
    ca = _controller_ca(env.settings())
    if ca is None:
        raise CliError("GRPC_INSECURE=true: the controller serves no TLS, so it has no CA")
    sys.stdout.write(ca.decode())
    return 0


def _cmd_token_create(args: argparse.Namespace) -> int:
    env = load_cli_env()
    if args.store:
        minted = _mint_in_store(args, env)
    else:
        body: dict[str, object] = {"ttl_seconds": args.ttl, "single_use": args.single_use}
        if args.node_name:
            body["node_name"] = args.node_name
        answer = env.admin().call("POST", "/api/admin/enrollment-tokens", body, 201)
        minted = {k: answer[k] for k in ("token", "token_id", "expires_at", "single_use")}
        minted["node_name"] = answer.get("node_name")
    if args.json:
        print(orjson.dumps(minted).decode())
    else:
        print(minted["token"])
    return 0


def _mint_in_store(args: argparse.Namespace, env: CliEnv) -> dict[str, object]:
    from infrastructure.tls import fingerprint_of

    settings = env.settings()
    ca = _controller_ca(settings)
    service = EnrollmentService(
        open_app(args, env),
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
    return dict(minted.__dict__)


def _cmd_models_register(args: argparse.Namespace) -> int:
    from domain.errors import DomainError

    env = load_cli_env()
    if not args.store:
        body: dict[str, object] = {
            "name": args.name,
            "sha256": args.sha256,
            "file_name": args.file_name,
            "context_size": args.context_size,
            "kind": args.kind,
            "pooling": args.pooling,
        }
        env.admin().call("POST", "/api/admin/models/", body, 201)
    else:
        app = open_app(args, env)
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


def _cmd_models_source(args: argparse.Namespace) -> int:
    from application.errors import NotFound
    from common.model_sources import SourceRefused, check_url, parse_cidrs
    from domain.errors import DomainError

    env = load_cli_env()
    if not args.store:
        path = "/api/admin/models/sources" + ("" if args.action == "add" else "/remove")
        expected = 201 if args.action == "add" else 200
        env.admin().call("POST", path, {"model": args.name, "url": args.url}, expected)
    else:
        if args.action == "add":  # what the admin API checks (nodes check again before a fetch)
            allowed = parse_cidrs(env.settings().model_source_allowed_cidrs)
            try:
                check_url(args.url, allowed)
            except SourceRefused as e:
                raise CliError(f"cannot add the source of {args.name}: {e}") from e
        app = open_app(args, env)
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
    admin = load_cli_env().admin(args.url)
    gone = admin.call(
        "POST", "/api/admin/models/evict", {"model": args.name, "node": args.node}, 200
    )
    print(f"deleted {gone['file_name']} from node {args.node}")
    return 0


def _cmd_models_pull(args: argparse.Namespace) -> int:
    """Asks the running controller (its admin API) to have nodes fetch a model."""
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    body: dict[str, object] = {"model": args.name, "nodes": nodes}
    admin = load_cli_env().admin(args.url)
    transfers = admin.call("POST", "/api/admin/models/pull", body, 202)["transfers"]
    for t in transfers:
        print(
            f"node {t['node_id']} fetches {args.name} from {', '.join(t['sources'])}"
            f" (transfer {t['transfer_id']})"
        )
    if not transfers:
        print(f"every node named holds {args.name} already")
    print("dacp diagnose NODE shows how it goes (MODEL_TRANSFER_*)")
    return 0


def _store_options(command: argparse.ArgumentParser) -> None:
    """``--store`` and the store it writes to (``--database-url``)."""
    store_flag(command)
    command.add_argument("--database-url", default=None, help="with --store: the event store")


def _admin_url_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--url",
        default=None,
        help="the controller's HTTP address (default: DACP_URL, from the environment or the "
        "config file); ADMIN_API_KEY is the key",
    )


def build_parser() -> argparse.ArgumentParser:
    # events, replay, diagnose, projections; nodes; the model store; usage; API keys
    from interfaces.cli import events_cli, keys_cli, nodes_cli, store_cli, usage_cli

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
    from wire.grpc_verbosity import GRPC_DEBUG_FLAG

    ctl.add_argument(
        GRPC_DEBUG_FLAG,
        action="store_true",
        help="let gRPC core print its own debug output (by default only its errors, unless "
        "GRPC_VERBOSITY or GRPC_TRACE is set)",
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
    _store_options(create)
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
    _store_options(reg)
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
    _store_options(source)
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
    keys_cli.register(sub)
    usage_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    take_used()
    try:
        code = int(args.func(args))
        for line in take_used():
            if code == 0:
                print(f"dacp: {line}", file=sys.stderr)
        return code
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
