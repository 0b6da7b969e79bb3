"""Make the cached llama.cpp build and test model exist: build or fetch on first use.

``ensure_llama()`` and ``ensure_model()`` are what the tests, the demo, the local cluster and
the benchmarks call before they need the binaries or the model; both are no-ops once the
artefact is cached. They sit above ``ops.build_llama`` and ``ops.fetch_model``, which in turn
sit above ``ops.paths`` (where the artefacts live), so no module here imports back up.
"""

from __future__ import annotations

from pathlib import Path

from agent.runtime.llama_backend import choose_backend
from ops import build_llama, fetch_model


def ensure_llama(backend: str | None = None) -> Path:
    """Build ``backend``'s llama.cpp binaries unless cached; return the bin directory.
    ``None`` (or ``auto``) is the backend ``$LLAMA_BACKEND`` names, else this machine's
    (:func:`agent.runtime.llama_backend.choose_backend`).

    Raises ``RuntimeError`` with a one-line reason when the build fails (``BackendError``, a
    ``ValueError``, for a name that is not a backend).
    """
    return build_llama.ensure_built(backend=choose_backend(backend, flag="backend").backend)


def ensure_model() -> Path:
    """Fetch and verify the test model unless cached; return its path.

    Raises ``RuntimeError`` with a one-line reason when the fetch or verification fails.
    """
    return fetch_model.ensure_fetched()
