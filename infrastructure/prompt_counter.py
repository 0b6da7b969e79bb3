"""Counts prompts for the models whose files the controller's own model store holds
(:class:`application.ports.PromptCounter`).

A file's tokenizer and chat template are read once (:mod:`infrastructure.gguf_tokenizer`,
:mod:`infrastructure.chat_template`: about a tenth of a second for a 50,000-token vocabulary,
in a worker thread) and kept for the next request. A prompt is rendered, and only tokenized
when its byte bound reaches the limit: a short prompt costs one template rendering.

The controller counts only with files it holds itself: a node's word on a tokenizer would let
one enrolled node have the controller refuse every request for a model. A model whose file
only nodes hold is counted by the node's server, which refuses an overlong prompt with the
same 400.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from application.commands import ChatPrompt, Prompt
from infrastructure.chat_template import ChatTemplate, TemplateFailed
from infrastructure.gguf_tokenizer import (
    GgufTokenizer,
    UnsupportedVocabulary,
    read_vocabulary,
    tokenizer_for,
)
from infrastructure.model_store import ControllerModelStore

log = logging.getLogger(__name__)

#: Model files whose tokenizers are kept at once (each some megabytes).
DEFAULT_KEPT = 8


@dataclass(frozen=True)
class Prompting:
    """What a model's server does to a request before it has tokens."""

    tokenizer: GgufTokenizer
    #: None: the file has no chat template this module can render.
    template: ChatTemplate | None


def load_prompting(path: Path) -> Prompting | None:
    """The tokenizer and chat template of the GGUF file at ``path``; None when its
    tokenization is not one :mod:`infrastructure.gguf_tokenizer` reproduces."""
    vocab = read_vocabulary(path)
    try:
        tokenizer = tokenizer_for(vocab)
    except UnsupportedVocabulary as e:
        log.info("%s: prompts are counted by the nodes' servers (unsupported %s)", path.name, e)
        return None
    template = None
    if vocab.chat_template:
        try:
            template = ChatTemplate(
                vocab.chat_template,
                tokenizer.bos_token,
                tokenizer.eos_token,
                strip_bos=tokenizer.add_bos,
            )
        except TemplateFailed as e:
            log.info("%s: chat prompts are counted by the nodes' servers (%s)", path.name, e)
    return Prompting(tokenizer, template)


class GgufPromptCounter:
    def __init__(self, store: ControllerModelStore, kept: int = DEFAULT_KEPT) -> None:
        self.store = store
        self.kept = kept
        self._loaded: OrderedDict[str, Prompting | None] = OrderedDict()
        self._loading: dict[str, asyncio.Future[Prompting | None]] = {}

    async def prompting(self, sha256: str) -> Prompting | None:
        """The file's tokenizer and template, loaded once (None: not held, or not supported).
        Once loaded they are kept in memory, so a request does not look for the file again."""
        if sha256 in self._loaded:
            self._loaded.move_to_end(sha256)
            return self._loaded[sha256]
        path = self.store.resolve(sha256)
        if path is None:
            return None
        loading = self._loading.get(sha256)
        if loading is None:
            loading = asyncio.get_running_loop().run_in_executor(None, load_prompting, path)
            self._loading[sha256] = loading
            loading.add_done_callback(lambda _: self._loading.pop(sha256, None))
        try:
            loaded = await asyncio.shield(loading)
        except (OSError, ValueError) as e:
            log.warning("reading the tokenizer of %s failed: %s", path.name, e)
            return None
        self._loaded[sha256] = loaded
        while len(self._loaded) > self.kept:
            self._loaded.popitem(last=False)
        return loaded

    async def prepare(self, sha256: str) -> None:
        await self.prompting(sha256)

    async def count(self, sha256: str, prompt: Prompt, limit: int) -> int | None:
        prompting = await self.prompting(sha256)
        if prompting is None:
            return None
        if isinstance(prompt, ChatPrompt):
            if prompting.template is None:
                return None
            try:
                text = prompting.template.render(prompt.messages, prompt.tools)
            except TemplateFailed as e:
                log.debug("chat template of %s: %s", sha256[:12], e)
                return None
        elif isinstance(prompt.text, str):
            text = prompt.text
        else:
            return len(prompt.text)
        tokenizer = prompting.tokenizer
        bound = tokenizer.upper_bound(text)
        if bound < limit:
            return bound
        return await asyncio.to_thread(tokenizer.count, text)
