"""Errors of the llama.cpp runtime, with the child's last output lines where there are any."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

#: What starts each run's output in a child's log (``=== <time> starting: <argv>``).
RUN_MARKER = "\n=== "

# --- errors ------------------------------------------------------------------------------


class LlamaRuntimeError(Exception):
    """Base class of everything this module raises."""


class RuntimeMissingError(LlamaRuntimeError):
    """A llama.cpp binary (or the model file) is not where it should be."""


class UnsafeBindError(LlamaRuntimeError, ValueError):
    """Refused to bind an RPC worker to a wildcard, public or malformed address."""


class PortInUseError(LlamaRuntimeError):
    """The requested port is already taken by another process."""


class _ProcessFailure(LlamaRuntimeError):
    def __init__(
        self,
        message: str,
        *,
        role: str,
        exit_code: int | None = None,
        stderr_tail: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        key = key_error_line(stderr_tail)
        super().__init__(f"{message}; last output: {key}" if key else message)
        self.role = role
        self.exit_code = exit_code
        self.stderr_tail = list(stderr_tail)
        self.log_path = log_path

    def last_output(self, max_bytes: int = 256 * 1024) -> list[str]:
        """The run's last output lines (up to ``max_bytes`` of its log, from its own start
        marker on): more than :attr:`stderr_tail` where an error is followed by many lines."""
        if self.log_path is None:
            return list(self.stderr_tail)
        try:
            with self.log_path.open("rb") as handle:
                size = handle.seek(0, 2)
                handle.seek(max(0, size - max_bytes))
                text = handle.read().decode("utf-8", errors="replace")
        except OSError:
            return list(self.stderr_tail)
        run = text.rsplit(RUN_MARKER, 1)[-1]
        return [line for line in run.splitlines() if line.strip()] or list(self.stderr_tail)


_ABORT_LINE = re.compile(r"\.(?:c|cc|cpp|h):\d+: ")  # GGML_ABORT / GGML_ASSERT location
_ERROR_LINE = re.compile(r"\berror\b|\bfailed\b|terminate called|what\(\)|\s[EF]\s", re.IGNORECASE)


def key_error_line(lines: Sequence[str]) -> str:
    """The most telling line of a child's last output: an abort site, an error, or the last."""
    lines = [line.strip() for line in lines if line.strip()]
    for pattern in (_ABORT_LINE, _ERROR_LINE):
        for line in reversed(lines):
            if pattern.search(line):
                return line
    return lines[-1] if lines else ""


class RuntimeStartError(_ProcessFailure):
    """A child process did not become ready (exited early or timed out)."""


class RuntimeCrashedError(_ProcessFailure):
    """A child process that was running exited without being asked to."""


class GenerationError(LlamaRuntimeError):
    """llama-server rejected or aborted a generation request."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ContextTooLong(GenerationError):
    """The prompt does not fit the context llama-server gives a slot (the request's fault)."""


class RequestRejected(GenerationError):
    """llama-server refused the request as invalid (400: a schema it cannot turn into a
    grammar, a history its chat template cannot render): the request's fault."""
