"""Registered models: the API name clients use, bound to one GGUF file by its sha256."""

from __future__ import annotations

import re
from typing import Any, ClassVar
from uuid import NAMESPACE_URL, UUID, uuid5

from eventsourcing.domain import Aggregate

from domain.errors import InvalidCommand
from domain.model_claims import STORE, implausible

#: The rules of a registration, as patterns the HTTP API also documents (JSON Schema flavour:
#: ``$`` is the end of the text). Matched whole: Python's ``$`` also matches before a final
#: newline, so ``re.match`` would let ``"name\n"`` through.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
SHA256_PATTERN = r"^[0-9a-fA-F]{64}$"
#: A plain ``*.gguf`` file name: no directory, not hidden.
FILE_NAME_PATTERN = r"^[^./\\][^/\\]*\.gguf$"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(MODEL_NAME_PATTERN)
_FILE_NAME = re.compile(FILE_NAME_PATTERN)
DEFAULT_CONTEXT_SIZE = 2048
MAX_URL_CHARS = 2048
#: An http(s) URL of a model file: a host name or address, an optional port and path.
#: (printable ASCII: what Python's and JSON Schema's regular expressions read alike)
SOURCE_URL_PATTERN = r"^https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?([/?#][!-~]*)?$"
_SOURCE_URL = re.compile(SOURCE_URL_PATTERN)
#: What a model serves: chat and legacy completions, or embeddings (its server runs with
#: ``--embeddings``; ``pooling`` picks how token vectors become one, "" = the model's own).
CHAT = "chat"
EMBEDDING = "embedding"
KINDS = (CHAT, EMBEDDING)
POOLINGS = ("", "mean", "cls", "last")
MIN_CONTEXT_SIZE = 128
MAX_CONTEXT_SIZE = 1_048_576


def is_model_name(name: str) -> bool:
    """Whether ``name`` may name a model (1-128 letters, digits or ``._:/-``)."""
    return _NAME.fullmatch(name) is not None


def model_id(name: str) -> UUID:
    return uuid5(NAMESPACE_URL, f"dacp:model:{name}")


def validate_use(kind: str, pooling: str) -> None:
    if kind not in KINDS:
        raise InvalidCommand(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if pooling not in POOLINGS:
        raise InvalidCommand(f"pooling must be one of {', '.join(p for p in POOLINGS if p)}")
    if pooling and kind != EMBEDDING:
        raise InvalidCommand("pooling is for embedding models only")


def validate_model(name: str, sha256: str, file_name: str, context_size: int) -> None:
    if not is_model_name(name):
        raise InvalidCommand(
            f"model name {name!r} must be 1-128 letters, digits or ._:/- and start with one "
            "letter or digit"
        )
    if not _SHA256.fullmatch(sha256):
        raise InvalidCommand("sha256 must be 64 lowercase hex digits")
    if not _FILE_NAME.fullmatch(file_name):
        raise InvalidCommand(f"file_name {file_name!r} must be a plain *.gguf file name")
    if not MIN_CONTEXT_SIZE <= context_size <= MAX_CONTEXT_SIZE:
        raise InvalidCommand(
            f"context_size must be between {MIN_CONTEXT_SIZE} and {MAX_CONTEXT_SIZE} tokens"
        )


class RegisteredModel(Aggregate):
    class Event(Aggregate.Event):
        code: ClassVar[str] = ""

    class Registered(Aggregate.Created):
        code: ClassVar[str] = "MODEL_REGISTERED"
        name: str
        sha256: str
        file_name: str
        context_size: int
        #: Absent from events stored before models had a kind: read with :func:`use_of`.
        kind: str
        pooling: str

    class Updated(Event):
        code: ClassVar[str] = "MODEL_UPDATED"
        sha256: str
        file_name: str
        context_size: int
        kind: str
        pooling: str

        def apply(self, aggregate: Any) -> None:
            if aggregate.sha256 != self.sha256:
                aggregate.stored = None  # the store's copy is of the file no longer registered
                aggregate.shape = aggregate.shape_from = aggregate.samples = None
            aggregate.sha256 = self.sha256
            aggregate.file_name = self.file_name
            aggregate.context_size = self.context_size
            aggregate.kind, aggregate.pooling = use_of(self)

    class Stored(Event):
        """The controller's model store holds the file (``dacp models add``). Its shape, read
        from the file there, lets the scheduler plan the model before any node holds it."""

        code: ClassVar[str] = "MODEL_STORED"
        size_bytes: int
        layers: int
        context_length: int
        kv_bytes_per_token: int
        architecture: str

        def apply(self, aggregate: Any) -> None:
            aggregate.stored = shape_of(self)
            # The controller read these facts itself: they replace a node's, and its samples.
            aggregate.shape, aggregate.shape_from, aggregate.samples = shape_of(self), STORE, None

    class Unstored(Event):
        """The controller's model store no longer holds the file (its facts stay: the file
        is the one its sha256 names, and they were read from it)."""

        code: ClassVar[str] = "MODEL_UNSTORED"

        def apply(self, aggregate: Any) -> None:
            aggregate.stored = None

    class ShapeFixed(Event):
        """The file's facts are fixed, with samples later proofs are checked against: read
        from the controller's model store (``source`` ``store``: only the samples are new),
        or, when only nodes hold the file, those of the first node that proved it holds it
        (``source``: its node id); or those another name of the same file holds (adopted,
        with that name's source and samples)."""

        code: ClassVar[str] = "MODEL_SHAPE_FIXED"
        size_bytes: int
        layers: int
        context_length: int
        kv_bytes_per_token: int
        architecture: str
        source: str
        #: The samples: ``nonce`` (hex) and ``[offset, length, sha256(nonce || bytes) hex]``.
        nonce: str
        samples: list[list[Any]]

        def apply(self, aggregate: Any) -> None:
            aggregate.shape, aggregate.shape_from = shape_of(self), self.source
            if self.samples:  # store facts adopted before their samples were taken: none yet
                aggregate.samples = {"nonce": self.nonce, "samples": self.samples}

    class SourceAdded(Event):
        """An http(s) URL the model's file can be fetched from (checked by its sha256)."""

        code: ClassVar[str] = "MODEL_SOURCE_ADDED"
        url: str

        def apply(self, aggregate: Any) -> None:
            aggregate.sources = [*getattr(aggregate, "sources", []), self.url]

    class SourceRemoved(Event):
        code: ClassVar[str] = "MODEL_SOURCE_REMOVED"
        url: str

        def apply(self, aggregate: Any) -> None:
            aggregate.sources = [u for u in getattr(aggregate, "sources", []) if u != self.url]

    def __init__(
        self,
        name: str,
        sha256: str,
        file_name: str,
        context_size: int,
        kind: str = CHAT,
        pooling: str = "",
    ) -> None:
        #: http(s) URLs the file can be fetched from, besides the nodes that hold it.
        self.sources: list[str] = []
        #: The file's shape when the controller's model store holds it (else None).
        self.stored: dict[str, Any] | None = None
        #: The file's facts (size and shape) and where they come from (``STORE`` or the id of
        #: the node whose proof fixed them); None until known. See domain/model_claims.py.
        self.shape: dict[str, Any] | None = None
        self.shape_from: str | None = None
        #: What proofs are checked against without a copy: {"nonce": hex, "samples": [...]}.
        self.samples: dict[str, Any] | None = None
        self.name = name
        self.sha256 = sha256
        self.file_name = file_name
        self.context_size = context_size
        self.kind = kind
        self.pooling = pooling

    @classmethod
    def register(
        cls,
        name: str,
        sha256: str,
        file_name: str,
        context_size: int = DEFAULT_CONTEXT_SIZE,
        kind: str = CHAT,
        pooling: str = "",
    ) -> RegisteredModel:
        sha256 = sha256.lower()
        validate_model(name, sha256, file_name, context_size)
        validate_use(kind, pooling)
        return cls._create(
            cls.Registered,
            id=model_id(name),
            name=name,
            sha256=sha256,
            file_name=file_name,
            context_size=context_size,
            kind=kind,
            pooling=pooling,
        )

    def update(
        self,
        sha256: str,
        file_name: str,
        context_size: int,
        kind: str = CHAT,
        pooling: str = "",
    ) -> bool:
        """Re-registration: records a change, or nothing when it is identical."""
        sha256 = sha256.lower()
        validate_model(self.name, sha256, file_name, context_size)
        validate_use(kind, pooling)
        new = (sha256, file_name, context_size, kind, pooling)
        if new == (self.sha256, self.file_name, self.context_size, self.kind, self.pooling):
            return False
        self.trigger_event(
            self.Updated,
            sha256=sha256,
            file_name=file_name,
            context_size=context_size,
            kind=kind,
            pooling=pooling,
        )
        return True

    def add_source(self, url: str) -> bool:
        """Records an http(s) URL of the file; False when it is known already."""
        validate_source(url)
        if url in getattr(self, "sources", []):
            return False
        self.trigger_event(self.SourceAdded, url=url)
        return True

    def store(
        self,
        *,
        size_bytes: int,
        layers: int,
        context_length: int,
        kv_bytes_per_token: int,
        architecture: str,
    ) -> bool:
        """Records that the controller's store holds the file; False when known already."""
        if size_bytes <= 0 or layers < 0 or context_length < 0 or kv_bytes_per_token < 0:
            raise InvalidCommand("a stored model file has a positive size and no negative shape")
        shape = {
            "size_bytes": size_bytes,
            "layers": layers,
            "context_length": context_length,
            "kv_bytes_per_token": kv_bytes_per_token,
            "architecture": architecture,
        }
        if getattr(self, "stored", None) == shape:
            return False
        self.trigger_event(self.Stored, **shape)
        return True

    def fix_shape(
        self,
        shape: dict[str, Any],
        source: str,
        nonce: str,
        samples: list[list[Any]],
        *,
        fixer_revoked: bool = False,
    ) -> None:
        """Records the file's facts with their samples (MODEL_SHAPE_FIXED). From the store:
        only when the store's facts have no samples yet (and ``shape`` is them). From a node's
        first proof: only when no facts are known, or the node that fixed them was revoked
        (``fixer_revoked``: the caller looked)."""
        if not samples:
            raise InvalidCommand("facts are fixed with samples of the file")
        current = getattr(self, "shape_from", None)
        if source == STORE:
            if current != STORE or getattr(self, "shape", None) != shape:
                raise InvalidCommand(f"the model store's facts of {self.name} are not these")
            if getattr(self, "samples", None) is not None:
                raise InvalidCommand(f"the model store's copy of {self.name} is sampled already")
        else:
            if current == STORE:
                raise InvalidCommand(f"the facts of {self.name} come from the model store")
            if current is not None and not fixer_revoked:
                raise InvalidCommand(f"the facts of {self.name} were fixed by node {current}")
            why = implausible(shape)
            if why is not None:
                raise InvalidCommand(f"no file is like that: {why}")
        self._shape_fixed(shape, source, nonce, samples)

    def adopt_facts(
        self,
        shape: dict[str, Any],
        source: str,
        nonce: str,
        samples: list[list[Any]],
        *,
        fixer_revoked: bool = False,
    ) -> None:
        """Takes the facts another name of the same file holds (MODEL_SHAPE_FIXED with that
        name's basis and samples): a file's facts are the file's, whichever name it goes by.
        Refused when this name has facts of its own that still count."""
        current = getattr(self, "shape_from", None)
        if current == STORE or (current is not None and not fixer_revoked):
            raise InvalidCommand(f"model {self.name} has facts of its own ({current})")
        if source != STORE and not samples:
            raise InvalidCommand("facts a node fixed travel with their samples")
        why = implausible(shape)
        if why is not None:
            raise InvalidCommand(f"no file is like that: {why}")
        self._shape_fixed(shape, source, nonce, samples)

    def _shape_fixed(
        self, shape: dict[str, Any], source: str, nonce: str, samples: list[list[Any]]
    ) -> None:
        self.trigger_event(
            self.ShapeFixed,
            size_bytes=int(shape["size_bytes"]),
            layers=int(shape["layers"]),
            context_length=int(shape["context_length"]),
            kv_bytes_per_token=int(shape["kv_bytes_per_token"]),
            architecture=str(shape["architecture"]),
            source=source,
            nonce=nonce,
            samples=samples,
        )

    def unstore(self) -> None:
        if getattr(self, "stored", None) is None:
            raise InvalidCommand(f"the controller's model store does not hold model {self.name}")
        self.trigger_event(self.Unstored)

    def remove_source(self, url: str) -> None:
        if url not in getattr(self, "sources", []):
            raise InvalidCommand(f"model {self.name} has no source {url!r}")
        self.trigger_event(self.SourceRemoved, url=url)


def validate_source(url: str) -> None:
    if _SOURCE_URL.fullmatch(url) is None or len(url) > MAX_URL_CHARS:
        raise InvalidCommand(
            f"a model source is an http(s) URL of at most {MAX_URL_CHARS} characters, "
            f"got {url[:80]!r}"
        )


def use_of(event: object) -> tuple[str, str]:
    """(kind, pooling) of a registration event; events from before kinds are chat models."""
    return str(getattr(event, "kind", CHAT)), str(getattr(event, "pooling", ""))


def shape_of(event: Any) -> dict[str, Any]:
    """The file shape a MODEL_STORED event records (the keys of a node's ``local_models``)."""
    return {
        "size_bytes": event.size_bytes,
        "layers": event.layers,
        "context_length": event.context_length,
        "kv_bytes_per_token": event.kv_bytes_per_token,
        "architecture": event.architecture,
    }
