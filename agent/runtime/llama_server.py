"""``llama-server``: the process on a free loopback port (its command line is a
:class:`agent.runtime.server_spec.ServerSpec`), and OpenAI-style chat completions streamed from
it."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from agent.runtime.endpoints import free_loopback_port, port_is_free
from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.llama_stream import LlamaStream, StreamProtocolError
from agent.runtime.managed_child import ExitCallback, ManagedChild, describe_exit
from agent.runtime.runtime_errors import (
    ContextTooLong,
    GenerationError,
    LlamaRuntimeError,
    PortInUseError,
    RequestRejected,
    RuntimeMissingError,
    RuntimeStartError,
    UnsafeBindError,
)
from agent.runtime.server_spec import DEFAULT_SERVER_VERBOSITY, ServerSpec
from common.contract import Endpoint

log = logging.getLogger(__name__)

#: llama-server's readiness endpoint: polled several times a second while a model loads.
HEALTH_PATH = "/health"
#: The logger httpx logs every request on, at INFO.
HTTPX_LOGGER = "httpx"


class HealthPollsAtDebug(logging.Filter):
    """httpx logs every request at INFO: its lines for ``/health`` polls go out at DEBUG (shown
    only when the agent logs at DEBUG); the others are left as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        url = args[1] if len(args) > 1 else None  # 'HTTP Request: %s %s "%s %d %s"'
        if record.levelno != logging.INFO or getattr(url, "path", None) != HEALTH_PATH:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_HEALTH_POLLS = HealthPollsAtDebug()


def log_health_polls_at_debug() -> None:
    """Installs :class:`HealthPollsAtDebug` on httpx's logger (once, however often called)."""
    logging.getLogger(HTTPX_LOGGER).addFilter(_HEALTH_POLLS)


@dataclass(frozen=True)
class ChatRequest:
    """The generation the agent asks llama-server for: a chat completion of ``messages`` (with
    the ``tools`` offered), or, given a ``prompt``, a legacy completion of it."""

    messages: Sequence[Mapping[str, Any]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Sequence[str] | str | None = None
    seed: int | None = None
    #: A legacy completion's prompt, text or token ids (None: a chat of ``messages``).
    prompt: str | Sequence[int] | None = None
    tools: Sequence[Mapping[str, Any]] = ()
    #: The only pass-through: request fields the controller validated, sent as they are
    #: (response_format, logprobs, penalties, tool_choice, ...).
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint.CHAT if self.prompt is None else Endpoint.COMPLETIONS

    @property
    def path(self) -> str:
        return COMPLETIONS_PATH if self.endpoint == Endpoint.COMPLETIONS else CHAT_PATH

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {**self.options}
        if self.prompt is None:
            body["messages"] = [dict(message) for message in self.messages]
            if self.tools:
                body["tools"] = [dict(tool) for tool in self.tools]
        else:
            body["prompt"] = self.prompt if isinstance(self.prompt, str) else list(self.prompt)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        optional = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        if self.stop is not None:
            body["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return body


@dataclass(frozen=True)
class Usage:
    """The tokens one request took, as llama-server reports them in ``usage``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: Of ``prompt_tokens``, those reused from the slot's cache
    #: (``prompt_tokens_details.cached_tokens``; None: not said).
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Timings:
    """llama-server's own measurements for one request."""

    prompt_tokens: int
    prompt_ms: float
    predicted_tokens: int
    predicted_ms: float
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: Prompt tokens taken from the slot's cache, not evaluated (``cache_n``; None: not said).
    cached_tokens: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.predicted_tokens * 1000.0 / self.predicted_ms if self.predicted_ms else 0.0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Timings:
        return cls(
            prompt_tokens=int(data.get("prompt_n", 0)),
            prompt_ms=float(data.get("prompt_ms", 0.0)),
            predicted_tokens=int(data.get("predicted_n", 0)),
            predicted_ms=float(data.get("predicted_ms", 0.0)),
            raw=dict(data),
            cached_tokens=int(data["cache_n"]) if "cache_n" in data else None,
        )


@dataclass(frozen=True)
class ChatDelta:
    """One streamed piece: new text, and on the last pieces finish reason, usage, timings.
    ``extra`` is what came with the text besides content, as JSON (``{"delta": {...},
    "logprobs": {...}}``: tool-call fragments, reasoning, logprobs), or empty."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    extra: str = ""


@dataclass(frozen=True)
class EmbeddingsRequest:
    """``/v1/embeddings`` of ``inputs``, texts or token id lists (validated by the controller),
    one vector each."""

    inputs: Sequence[str] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class Embeddings:
    data: list[Any]
    prompt_tokens: int


class LlamaServer(ManagedChild):
    """``llama-server`` for one :class:`ServerSpec` on a free loopback port."""

    role = "llama-server"

    def __init__(
        self,
        binaries: RuntimeBinaries,
        spec: ServerSpec,
        *,
        log_dir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        verbosity: int = DEFAULT_SERVER_VERBOSITY,
        on_exit: ExitCallback | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(log_dir=log_dir, on_exit=on_exit, env=env)
        self.verbosity = verbosity
        address = ipaddress.ip_address(host)
        if address.is_unspecified:
            raise UnsafeBindError("llama-server is for the local agent only; bind 127.0.0.1")
        self.binaries = binaries
        self.spec = spec
        self.host = host
        self._fixed_port = port
        self.port = port or 0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def health(self, timeout: float = 2.0) -> bool:
        """True when ``/health`` answers 200 (the model is loaded)."""
        try:
            response = httpx.get(f"{self.base_url}{HEALTH_PATH}", timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def start(self, timeout: float = 180.0) -> None:
        """Start and wait until ``/health`` is OK; retries a port lost to a race."""
        if self.alive:
            return
        model = Path(self.spec.model_path)
        if not model.is_file():
            raise RuntimeMissingError(f"model file not found: {model}")
        attempts = 1 if self._fixed_port else 3
        for attempt in range(1, attempts + 1):
            self.port = self._fixed_port or free_loopback_port(self.host)
            if self._fixed_port and not port_is_free(self.host, self.port):
                raise PortInUseError(f"cannot start llama-server: {self.endpoint} is in use")
            argv = self.spec.argv(self.binaries.llama_server, self.host, self.port, self.verbosity)
            self._spawn(argv, "llama-server.log")
            try:
                self._wait_healthy(timeout)
                return
            except RuntimeStartError as exc:
                bind_lost = any("bind" in line.lower() for line in exc.stderr_tail)
                if attempt == attempts or not bind_lost:
                    raise
                log.warning("llama-server lost port %s to another process; retrying", self.port)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, verify=False) as client:  # loopback HTTP: no CA bundle
            while True:
                if not self.alive:
                    raise self._start_failure(f"{describe_exit(self.exit_code)} during startup")
                try:
                    if client.get(f"{self.base_url}{HEALTH_PATH}").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    self.stop()
                    raise self._start_failure(f"was not healthy within {timeout:.0f}s")
                time.sleep(0.2)

    async def stream_chat(
        self, request: ChatRequest, *, read_timeout: float = 300.0
    ) -> AsyncGenerator[ChatDelta, None]:
        """Stream ``/v1/chat/completions`` as :class:`ChatDelta` items while they arrive (over
        a connection of its own: :mod:`agent.runtime.llama_stream`, the per-token path).

        Closing the generator (``aclose()``, ``break`` in ``async for`` plus garbage
        collection, or cancelling the consuming task) closes the HTTP connection, which makes
        llama-server stop generating for this request.
        """
        self.check()
        payload = _json_bytes(request.payload())
        exchange = LlamaStream(
            self.host, self.port, request.path, payload, read_timeout=read_timeout
        )
        try:
            async with exchange as resp:
                if resp.status != 200:
                    body = (await resp.read_all()).decode("utf-8", errors="replace")
                    error = _refusal(resp.status, body)
                    raise error(
                        f"llama-server returned {resp.status}: {_error_message(body)}",
                        status_code=resp.status,
                    )
                async for line in _sse_lines(resp.body()):
                    delta = _parse_sse_line(line)
                    if delta is _DONE:
                        return
                    if isinstance(delta, ChatDelta):
                        yield delta
            raise await self._stream_broken("stream ended without [DONE]")
        except (OSError, TimeoutError, StreamProtocolError) as exc:
            raise await self._stream_broken(_describe(exc)) from exc

    async def embed(
        self, request: EmbeddingsRequest, *, client: httpx.AsyncClient, read_timeout: float = 300.0
    ) -> Embeddings:
        """``/v1/embeddings`` (float vectors, in input order)."""
        self.check()
        timeout = httpx.Timeout(connect=5.0, read=read_timeout, write=30.0, pool=30.0)
        inputs = [item if isinstance(item, str) else list(item) for item in request.inputs]
        body = {"input": inputs, "encoding_format": "float"}
        try:
            resp = await client.post(f"{self.base_url}/v1/embeddings", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise await self._stream_broken(_describe(exc)) from exc
        if resp.status_code != 200:
            error = _refusal(resp.status_code, resp.text)
            raise error(
                f"llama-server returned {resp.status_code}: {_error_message(resp.text)}",
                status_code=resp.status_code,
            )
        answer = resp.json()
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            raise GenerationError("llama-server answered /v1/embeddings without a data list")
        usage = answer.get("usage") or {}
        return Embeddings(data, int(usage.get("prompt_tokens", 0)))

    async def _stream_broken(self, reason: str) -> LlamaRuntimeError:
        # A crash shows up as a broken stream just before the exit: give the process a moment
        # (an abort can take a while to finish writing its report).
        for _ in range(40):
            if not self.alive:
                break
            await asyncio.sleep(0.05)
        if self._proc is not None and not self.alive and not self._stopping:
            return self._exit_info(self._proc.returncode).error()
        return GenerationError(f"llama-server stream failed: {reason}")


class _Done:
    pass


#: Delta fields that are not extras: the text itself, and the role of the first chunk.
_PLAIN = frozenset({"content", "role"})
#: The paths of the generation endpoints (``ChatRequest.endpoint``, a ``common.contract.Endpoint``).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


_DONE = _Done()


async def _sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of an SSE body as bytes, without their ``\n`` or ``\r\n``, however the
    body is cut into chunks (a last line without an ending is given too).

    One token per event makes this the agent's per-token hot path: bytes are split as they
    come, with no text decoding before the JSON parser (orjson reads UTF-8 bytes itself).
    """
    rest = b""
    async for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line[:-1] if line.endswith(b"\r") else line
    if rest:
        yield rest[:-1] if rest.endswith(b"\r") else rest


def _parse_sse_line(line: bytes) -> ChatDelta | _Done | None:
    if not line.startswith(b"data:"):
        return None  # blank separators, ": ping" comments, event: lines
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        shown = data[:200].decode("utf-8", errors="replace")
        raise GenerationError(f"llama-server sent malformed stream data: {shown}") from None
    if not isinstance(chunk, dict):
        return None
    if "error" in chunk:
        raise GenerationError(f"llama-server aborted the stream: {_error_message(chunk)}")
    text = ""
    finish_reason: str | None = None
    extra = b""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is None:  # a legacy completion
            text += choice.get("text") or ""
            rest = {}
        else:
            text += delta.get("content") or ""
            # Most deltas hold content alone: nothing more to look at on the per-token path.
            rest = (
                {k: v for k, v in delta.items() if v is not None and k not in _PLAIN}
                if len(delta) > 1 or "content" not in delta
                else {}
            )
        logprobs = choice.get("logprobs")
        if rest or logprobs:
            extra = orjson.dumps({"delta": rest, "logprobs": logprobs})
        finish_reason = choice.get("finish_reason") or finish_reason
    usage_json = chunk.get("usage")
    usage = None
    if isinstance(usage_json, dict):
        usage = Usage(
            prompt_tokens=int(usage_json.get("prompt_tokens", 0)),
            completion_tokens=int(usage_json.get("completion_tokens", 0)),
            total_tokens=int(usage_json.get("total_tokens", 0)),
            cached_tokens=_cached_tokens(usage_json),
        )
    timings_json = chunk.get("timings")
    timings = Timings.from_json(timings_json) if isinstance(timings_json, dict) else None
    if not text and not extra and finish_reason is None and usage is None and timings is None:
        return None
    return ChatDelta(text, finish_reason, usage, timings, extra.decode() if extra else "")


def _cached_tokens(usage: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, or None where it is not said."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])


def _refusal(status: int, body: str) -> type[GenerationError]:
    """What a non-200 answer from llama-server means: the request's fault (its prompt too long
    for the context, or invalid) or a failure of generation."""
    if _exceeds_context(body):
        return ContextTooLong
    if status == 400:
        return RequestRejected
    return GenerationError


def _exceeds_context(body: str) -> bool:
    """Whether llama-server refused the request because its prompt does not fit the slot's
    context (``exceed_context_size_error``)."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    return isinstance(error, dict) and error.get("type") == "exceed_context_size_error"


def _json_bytes(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON (orjson; the standard library for what orjson refuses, an integer
    beyond 64 bits, say, so that llama-server judges it as it would have before)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _describe(exc: BaseException) -> str:
    """A transport failure in a few words: its kind, and its message when it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _error_message(body: str | Mapping[str, Any]) -> str:
    data: Any = body
    if isinstance(body, str):
        try:
            data = json.loads(body)
        except ValueError:
            return body.strip()[:300] or "(empty body)"
    if isinstance(data, Mapping):
        error = data.get("error", data)
        if isinstance(error, Mapping):
            return str(error.get("message") or error)
        return str(error)
    return str(data)[:300]
