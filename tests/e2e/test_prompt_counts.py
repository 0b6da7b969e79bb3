"""The controller counts a prompt as the node's llama-server will, so it can refuse one that
does not fit before any node sees it (infrastructure/prompt_counter.py). Compared with a real
llama-server on the test model: the tokens of any text (``/tokenize``), the prompt tokens of
chat requests (``usage.prompt_tokens``: template and tokenizer together), and the verdict at
the very edge of a slot's context, served the way an agent serves it (two slots, no unified
cache, a per-slot context llama.cpp pads)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.runtime.endpoints import free_loopback_port
from application.commands import ChatPrompt
from application.context_guard import ContextGuard, ContextLengthExceeded
from infrastructure.model_store import ControllerModelStore
from infrastructure.prompt_counter import GgufPromptCounter, Prompting, load_prompting
from ops.artifacts import ensure_llama, ensure_model
from ops.paths import llama_server_path, sha256_file

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: Per slot, as a model registered with --context-size 300 is served (padded to 512).
PER_SLOT = 300
SLOTS = 2


@pytest.fixture(scope="module")
def server() -> Iterator[httpx.Client]:
    ensure_llama()
    port = free_loopback_port()
    argv = [str(llama_server_path()), "--model", str(ensure_model()), "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--ctx-size", str(PER_SLOT * SLOTS), "--parallel", "2"]
    argv += ["--no-webui", "--threads", "1"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {process.returncode}")
            asyncio.run(asyncio.sleep(0.1))
        yield client
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def prompting() -> Prompting:
    loaded = load_prompting(ensure_model())
    assert loaded is not None and loaded.template is not None
    return loaded


@pytest.fixture(scope="module")
def counter(tmp_path_factory: pytest.TempPathFactory) -> tuple[GgufPromptCounter, str]:
    """A counter over a controller model store that holds the test model."""
    store_dir = tmp_path_factory.mktemp("store")
    sha = sha256_file(ensure_model())
    shutil.copyfile(ensure_model(), store_dir / f"{sha}.gguf")
    return GgufPromptCounter(ControllerModelStore(store_dir)), sha


TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cn", "Co")),
    min_size=1,
    max_size=200,
) | st.lists(
    st.sampled_from(["<|im_start|>", "<|im_end|>", " ", "\n", "llama", "🦙", "12345", "'s"]),
    min_size=1,
    max_size=30,
).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT)
@example(text="+\x06=")  # a byte the vocabulary lacks keeps "+" and "=" apart, then is dropped
def test_any_text_tokenizes_as_llama_server_does(
    server: httpx.Client, prompting: Prompting, text: str
) -> None:
    body = {"content": text, "add_special": True, "parse_special": True}
    expected = server.post("/tokenize", json=body).json()["tokens"]
    assert prompting.tokenizer.encode(text) == expected
    assert prompting.tokenizer.count(text) == len(expected)  # SmolLM2 adds no BOS


def prompt_tokens(server: httpx.Client, messages: list[dict[str, Any]]) -> int:
    answer = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens"])


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there!  How are   you?\n\n"},
    ],
    [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y <|im_end|> z"},
        {"role": "user", "content": "café 🦙 12345 ümlaut\t tab"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
        }
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_a_chat_prompt_counts_as_the_server_counts_it(
    server: httpx.Client, prompting: Prompting, messages: list[dict[str, Any]]
) -> None:
    assert prompting.template is not None
    rendered = prompting.template.render(messages, [])
    assert prompting.tokenizer.count(rendered) == prompt_tokens(server, messages)


def test_at_the_edge_of_the_context_the_guard_and_the_server_agree(
    server: httpx.Client, counter: tuple[GgufPromptCounter, str]
) -> None:
    """Prompts of the slot's context minus two to plus one tokens: the server answers exactly
    those the guard lets through, and refuses the others with its context error."""
    gguf_counter, sha = counter
    model = {"sha256": sha, "context_size": PER_SLOT, "shape": {"context_length": 8192}}
    guard = ContextGuard(gguf_counter)
    seen: dict[int, bool] = {}
    for words in range(200, 520):
        messages = [{"role": "user", "content": "go" + " a" * words}]
        tokens = asyncio.run(gguf_counter.count(sha, ChatPrompt(messages), 512))
        assert tokens is not None
        if not 510 <= tokens <= 513 or tokens in seen:
            continue
        try:
            asyncio.run(guard.check(model, ChatPrompt(messages)))
            admitted = True
        except ContextLengthExceeded as refused:
            assert refused.context == 512
            admitted = False
        answer = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert (answer.status_code == 200) == admitted, (tokens, answer.text)
        if not admitted:
            assert answer.json()["error"]["type"] == "exceed_context_size_error"
        seen[tokens] = admitted
    assert seen == {510: True, 511: True, 512: False, 513: False}


def test_a_short_prompt_is_bounded_without_tokenizing(
    counter: tuple[GgufPromptCounter, str],
) -> None:
    gguf_counter, sha = counter
    prompt = ChatPrompt([{"role": "user", "content": "Hi"}])
    bound = asyncio.run(gguf_counter.count(sha, prompt, 2048))
    exact = asyncio.run(gguf_counter.count(sha, prompt, 1))
    assert bound is not None and exact is not None and exact <= bound < 2048
    assert asyncio.run(gguf_counter.count("0" * 64, prompt, 1)) is None  # a file not held


def test_the_counter_loads_a_file_once(counter: tuple[GgufPromptCounter, str]) -> None:
    gguf_counter, sha = counter

    async def twice() -> tuple[Prompting | None, Prompting | None]:
        return await asyncio.gather(gguf_counter.prompting(sha), gguf_counter.prompting(sha))

    first, second = asyncio.run(twice())
    assert first is not None and first is second
