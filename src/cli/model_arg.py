"""What ``--model`` names: a checkpoint folder checked for its layout, a
GGUF file or registered name converted (and fetched) on first use, or the
default model; and the ``--quantization`` that ``auto`` means for it.

The model modules load NumPy, so they are imported inside the functions:
``kvserve.cli.main`` sets the thread pools' environment before NumPy loads.
"""

from __future__ import annotations

import re
from pathlib import Path

import structlog

from kvserve.cli.errors import die
from kvserve.observability.log import LoadProgress

log = structlog.get_logger("kvserve.cli")

#: The checkpoint layout ``--model`` takes (``kvserve.model.loader`` and ``.tokenizer``).
CHECKPOINT_FILES = "config.json, *.safetensors, tokenizer.json"
#: What ``serve`` and ``generate`` run without ``--model`` (``kvserve.model.default_model``).
DEFAULT_MODEL = "the default model (SmolLM2-135M-Instruct)"
#: A hub model id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")


def model_folder_problem(model: str) -> str | None:
    """Why ``--model model`` is not something kvserve can load, as one line,
    or None when it is. A registered name (``gemma-3-270m``) and a GGUF file
    (or a folder holding one ``.gguf`` and no ``config.json``) are accepted:
    they are fetched or converted on first use, and the converter's errors
    are one line too (``ConversionError``). Otherwise only the layout is
    checked (a folder with ``config.json``, ``*.safetensors`` (or the
    ``.gguf`` it is served from) and ``tokenizer.json``); the contents are
    the loader's."""
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.gguf_model import gguf_file_of, is_model_name
    from kvserve.model.loader import SUPPORTED_MODEL_TYPES

    if is_model_name(model):
        return None
    try:
        if gguf_file_of(model) is not None:
            return None
    except ValueError as exc:
        return str(exc)
    *others, last = [t for t in SUPPORTED_MODEL_TYPES if t != "gemma3_text"]
    accepts = (f"pass a Hugging Face-layout folder ({CHECKPOINT_FILES}) of a "
               f"{', '.join(others)} or {last} model, or a .gguf file")
    path = Path(model)
    if not path.exists() and path.suffix == ".gguf":
        return f"--model {model}: no such file; {accepts}"
    if not path.exists():
        if _HUB_ID.match(model):
            return (f"--model {model}: no such folder; kvserve serves local folders and does not "
                    f"fetch model ids from a hub: download the checkpoint ({CHECKPOINT_FILES}) "
                    f"and pass its folder, or leave --model out to serve {DEFAULT_MODEL} "
                    "(`kvserve fetch-model` fetches it)")
        return (f"--model {model}: no such folder; {accepts}, or leave --model out for "
                f"{DEFAULT_MODEL}")
    if not path.is_dir():
        return f"--model {model} is a file, not a folder; {accepts}"
    missing = [name for name, found in (
        ("config.json", (path / "config.json").is_file()),
        ("*.safetensors", any(path.glob("*.safetensors")) or any(path.glob("*.gguf"))),
        ("tokenizer.json", (path / "tokenizer.json").is_file())) if not found]
    if missing:
        return f"--model {model}: no {', '.join(missing)} in this folder; {accepts}"
    return None


def require_model_folder(model: str) -> None:
    """``die`` with ``model_folder_problem``'s line, before any loading."""
    problem = model_folder_problem(model)
    if problem is not None:
        die(problem)


def default_model_folder() -> Path:
    """Where the default model's checkpoint is (or will be) in the cache."""
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.default_model import DEFAULT_MODEL_NAME, cache_dir

    return cache_dir() / DEFAULT_MODEL_NAME


def fetch_default_model() -> Path:
    """``ensure_default_model``, with progress lines while a first use
    fetches and converts it (none when it is in the cache already)."""
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.default_model import ensure_default_model

    if model_folder_problem(str(default_model_folder())) is None:
        return ensure_default_model()
    with LoadProgress(log) as progress, progress.step(
            "fetch", "fetching and converting the default model"):
        return ensure_default_model()


def model_needs_work(model: str) -> bool:
    """True when ``--model model`` must be fetched or converted first (then
    the server listens, answering 503 ``loading``, while that happens)."""
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.gguf_model import needs_work

    return needs_work(model)


def resolve_model_arg(model: str) -> str:
    """``--model``'s checkpoint folder (``kvserve.model.gguf_model.resolve_model``):
    a GGUF file or a registered name converted (and fetched) on first use,
    with progress lines while it works; a folder as it is. A file that
    cannot be converted is a ``ValueError`` of one line naming it."""
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.gguf_model import ConversionError, needs_work, resolve_model

    try:
        if not needs_work(model):
            return resolve_model(model)
        with LoadProgress(log) as progress, progress.step(
                "convert", f"fetching and converting {model}"):
            return resolve_model(model)
    except ConversionError as exc:
        raise ValueError(f"--model {model}: cannot convert it: {exc}") from None


def default_quantization(quantization: str, model: str | None, backend: str) -> str:
    """``--quantization``, with ``auto`` resolved: a GGUF file (or a folder of
    one, or a registered GGUF name) is served on its own blocks, ``w4a8`` on
    the CPU (``none`` on a GPU: dequantized in memory); anything else, the
    default model included, ``none``."""
    if quantization != "auto":
        return quantization
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.gguf_model import gguf_file_of, is_model_name

    if model is None:
        return "none"
    try:
        is_gguf = is_model_name(model) or gguf_file_of(model) is not None
    except ValueError:
        is_gguf = False
    return "w4a8" if is_gguf and backend == "cpu" else "none"
