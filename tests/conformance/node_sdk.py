"""Run the official Node ``openai`` SDK's conformance checks (``node/conformance.mjs``).

The script prints one JSON line per check, ``{"check": ..., "ok": ..., "detail": ...}``;
this module runs it with the configuration in its environment and collects those lines.
``python3 -m ops.bootstrap test`` installs its ``node_modules`` (``npm ci``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

NODE_DIR: Path = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "conformance.mjs"


def node_modules_ready() -> bool:
    """True when ``node`` is on PATH and the SDK and ajv are installed next to the script."""
    modules = NODE_DIR / "node_modules"
    return (
        shutil.which("node") is not None
        and (modules / "openai" / "package.json").is_file()
        and (modules / "ajv" / "package.json").is_file()
    )


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty)"


def run_node_conformance(
    base_url: str,
    api_key: str,
    chat_model: str,
    embed_model: str,
    embed_dim: int,
    refused: list[dict[str, Any]],
    only: list[str] | None = None,
    timeout: float = 600,
) -> dict[str, tuple[bool, str]]:
    """Run the checks (all, or ``only`` those) and return ``{check: (ok, detail)}``.

    A failing check is a result, not an exception; ``RuntimeError`` (with the tail of
    stderr) means the script produced no result at all.
    """
    env = {
        **os.environ,
        "DACP_BASE_URL": base_url,
        "DACP_API_KEY": api_key,
        "DACP_CHAT_MODEL": chat_model,
        "DACP_EMBED_MODEL": embed_model,
        "DACP_EMBED_DIM": str(embed_dim),
        "DACP_REFUSED": json.dumps(refused),
        "DACP_ONLY": ",".join(only or ()),
    }
    try:
        proc = subprocess.run(
            ["node", SCRIPT.name],
            cwd=NODE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raw = exc.stderr or ""
        stderr = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        raise RuntimeError(
            f"node conformance timed out after {timeout:g}s; stderr:\n{_tail(stderr)}"
        ) from exc
    except OSError as exc:
        raise RuntimeError(f"cannot run node (Node.js 20+ is needed): {exc}") from exc
    results: dict[str, tuple[bool, str]] = {}
    for line in proc.stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("check"), str):
            results[record["check"]] = (record.get("ok") is True, str(record.get("detail", "")))
    if not results:
        raise RuntimeError(
            f"node conformance (exit {proc.returncode}) printed no results; stderr:\n"
            f"{_tail(proc.stderr)}\nstdout:\n{_tail(proc.stdout)}"
        )
    return results
