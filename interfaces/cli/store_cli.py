"""``dacp models add PATH`` and ``dacp models unstore NAME``: the controller's own model store.

``add`` copies a GGUF file into ``MODEL_STORE_DIR`` (default ``var/models``) and hashes it in
the same pass, with progress; then it registers the model (or updates its registration) and
records MODEL_STORED with the file's shape, so the scheduler can plan the model and nodes can
fetch it before any node holds it. Run it on the controller's machine (it writes the store
directory and the event store, as ``dacp models register`` does); a running controller serves
the file from then on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from interfaces.cli.cli_target import load_cli_env


class _Progress:
    """One line per 10 % on a pipe; one line rewritten in place on a terminal."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = time.monotonic()
        self.shown = -1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        percent = 100 if not total else done * 100 // total
        step = percent if self.tty else percent // 10 * 10
        if step == self.shown:
            return
        self.shown = step
        rate = done / max(time.monotonic() - self.started, 1e-6) / 1e6
        line = (
            f"copying {self.name}: {percent:3d}% ({done >> 20} / {total >> 20} MiB, "
            f"{rate:.0f} MB/s)"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr)
        if self.tty and done >= total:
            print(file=sys.stderr)


def _cmd_add(args: argparse.Namespace) -> int:
    from eventsourcing.application import AggregateNotFoundError

    from common.gguf_metadata import read_gguf_metadata
    from domain.errors import DomainError
    from domain.model import (
        DEFAULT_CONTEXT_SIZE,
        MIN_CONTEXT_SIZE,
        RegisteredModel,
        model_id,
        validate_model,
        validate_use,
    )
    from infrastructure.model_store import ControllerModelStore, StoredFile, StoreError
    from interfaces.cli.cli_target import CliError, open_app

    source = Path(args.path).expanduser()
    if not source.is_file():
        raise CliError(f"{source} is not a file")
    try:
        shape = read_gguf_metadata(source)
    except Exception as e:  # gguf raises what it raises for a file that is not GGUF
        raise CliError(f"{source} is not a readable GGUF file: {e}") from e
    name = args.name or source.stem
    context_size = args.context_size
    if context_size is None:
        context_size = min(DEFAULT_CONTEXT_SIZE, shape.context_length or DEFAULT_CONTEXT_SIZE)
        context_size = max(context_size, MIN_CONTEXT_SIZE)
    try:  # what the registration will check, before a byte is copied
        validate_model(name, "0" * 64, source.name, context_size)
        validate_use(args.kind, args.pooling)
    except DomainError as e:
        raise CliError(f"cannot add {source}: {e}") from e
    env = load_cli_env()
    store = ControllerModelStore(env.settings().model_store_dir)
    app = open_app(args, env)  # the event store answers before a byte is copied
    stored: StoredFile | None = None
    try:
        try:
            stored = store.add(source, _Progress(source.name))
        except StoreError as e:
            raise CliError(str(e)) from e
        try:
            before: RegisteredModel = app.repository.get(model_id(name))
            replaced = before.sha256 if getattr(before, "stored", None) else None
        except AggregateNotFoundError:
            replaced = None
        app.store_model(
            name,
            stored.sha256,
            source.name,
            {
                "size_bytes": stored.size_bytes,
                "layers": shape.layers,
                "context_length": shape.context_length,
                "kv_bytes_per_token": shape.kv_bytes_per_token,
                "architecture": shape.architecture,
            },
            context_size,
            args.kind,
            args.pooling,
        )
    except Exception as e:  # the copy is of no use unregistered (unless another name has it)
        if stored is not None and not store.names(stored.sha256):
            store.remove(stored.sha256)
        if isinstance(e, DomainError):
            raise CliError(f"model {name} was not registered: {e}") from e
        raise
    finally:
        app.close()
    store.keep(stored.sha256, name)
    if replaced is not None and replaced != stored.sha256:
        store.release(replaced, name)  # the file model NAME had before
    print(
        f"stored {source.name} ({stored.size_bytes} bytes, sha256 {stored.sha256[:12]}…) in "
        f"{store.directory}; {args.kind} model {name} registered: nodes fetch it from the "
        "controller when they need it"
    )
    return 0


def _cmd_unstore(args: argparse.Namespace) -> int:
    from application.errors import NotFound
    from domain.errors import DomainError
    from domain.model import model_id
    from infrastructure.model_store import ControllerModelStore
    from interfaces.cli.cli_target import CliError, open_app

    app = open_app(args)
    try:
        app.unstore_model(args.name)
        sha256: str = app.repository.get(model_id(args.name)).sha256
    except (DomainError, NotFound) as e:
        raise CliError(f"cannot unstore {args.name}: {e}") from e
    finally:
        app.close()
    store = ControllerModelStore(load_cli_env().settings().model_store_dir)
    removed = store.release(sha256, args.name)
    others = sorted(store.names(sha256))
    print(
        f"model {args.name} is no longer in the controller's model store"
        + (f" (its file stays: {', '.join(others)} use it)" if others else "")
        + ("" if removed or others else " (its file was already gone)")
    )
    return 0


def register(models_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add = models_sub.add_parser(
        "add",
        help="copy a GGUF file into the controller's model store and register it (nodes fetch "
        "it from there)",
    )
    add.add_argument("path", help="the GGUF file")
    add.add_argument(
        "--name",
        default="",
        help="the name clients pass as `model` (default: the file name without .gguf)",
    )
    add.add_argument(
        "--context-size",
        type=int,
        default=None,
        help="tokens of context per request (default: 2048, or less if the model has less)",
    )
    add.add_argument("--kind", choices=("chat", "embedding"), default="chat")
    add.add_argument("--pooling", choices=("mean", "cls", "last"), default="")
    add.add_argument("--database-url", default=None, help="default: DATABASE_URL or var/")
    add.set_defaults(func=_cmd_add)
    unstore = models_sub.add_parser(
        "unstore", help="delete a model's file from the controller's model store"
    )
    unstore.add_argument("name", help="the registered model")
    unstore.add_argument("--database-url", default=None, help="default: DATABASE_URL or var/")
    unstore.set_defaults(func=_cmd_unstore)
