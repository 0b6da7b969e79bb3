"""``dacp``: the controller's command line (controller, tokens, ...).

Errors end with exit code 2 and one line on stderr; nothing half-done is recorded.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import orjson

from application.enrollment import (
    EnrollmentNotConfigured,
    enrollment_key,
    mint_enrollment_token,
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
    try:
        event_loop.run(serve_forever(settings))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        raise CliError(str(e)) from e
    return 0


def _cmd_token_create(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    try:
        minted = mint_enrollment_token(
            enrollment_key(settings.node_enrollment_secret),
            ttl_seconds=args.ttl,
            single_use=args.single_use,
            node_name=args.node_name,
            now=time.time(),
        )
    except EnrollmentNotConfigured as e:
        raise CliError(str(e)) from e
    except ValueError as e:
        raise CliError(str(e)) from e
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
        app.register_model(args.name, args.sha256, args.file_name, args.context_size)
    except DomainError as e:
        raise CliError(str(e)) from e
    finally:
        app.close()
    print(f"registered model {args.name} → {args.file_name} ({args.sha256[:12]}…)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dacp", description="Distributed AI Compute Platform")
    sub = parser.add_subparsers(dest="command", required=True)

    ctl = sub.add_parser("controller", help="run the controller (HTTP + gRPC) in the foreground")
    ctl.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "warning"))
    ctl.set_defaults(func=_cmd_controller)

    token = sub.add_parser("token", help="enrollment tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="mint a token signed with NODE_ENROLLMENT_SECRET")
    create.add_argument("--ttl", type=float, default=3600.0, help="seconds until it expires")
    create.add_argument("--single-use", action="store_true", help="valid for one enrollment")
    create.add_argument("--node-name", default=None, help="bind the token to this node name")
    create.add_argument("--json", action="store_true", help="print token details as JSON")
    create.set_defaults(func=_cmd_token_create)
    models = sub.add_parser("models", help="the model registry")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    reg = models_sub.add_parser("register", help="register a model's API name and GGUF file")
    reg.add_argument("name", help="the name clients pass as `model`")
    reg.add_argument("--sha256", required=True, help="sha256 of the GGUF file")
    reg.add_argument("--file-name", required=True, help="the GGUF file name on the agents")
    reg.add_argument("--context-size", type=int, default=2048)
    reg.add_argument("--database-url", default=None, help="default: DATABASE_URL or var/")
    reg.set_defaults(func=_cmd_models_register)

    from interfaces import events_cli  # events, replay, diagnose, projections

    events_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, SettingsError) as e:
        print(f"dacp: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
