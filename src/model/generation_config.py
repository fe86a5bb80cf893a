"""A checkpoint's ``generation_config.json`` as default sampling fields (``--generation-config``).

vLLM applies the sampling fields of a model's Hugging Face
``generation_config.json`` to every request that omits them
(``ModelConfig.get_diff_sampling_param``): ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as
``max_tokens``. Where the file comes from is ``--generation-config``:

- ``auto`` (the default): the model folder's own file; none there, no defaults.
- ``vllm``: no file at all; requests get the engine's neutral defaults
  (temperature 1, top_p 1, no top_k or min_p, no repetition penalty).
- a folder path: that folder's ``generation_config.json``. As in vLLM
  (``get_max_tokens``'s ``override_max_tokens``), its ``max_new_tokens`` is
  then also an upper bound on every request's ``max_tokens``, not only the
  default of a request that omits it.

Every other key (``bos_token_id``, ``eos_token_id``, ``do_sample``,
``max_length``, ...) is ignored, as vLLM ignores it for sampling:
``do_sample: false`` does not make the defaults greedy. Deviations from
vLLM: a folder given to ``--generation-config`` that lacks the file is an
error (vLLM silently applies nothing), a file that is not a JSON object or
holds a bad value is refused with a message naming the file and the key
(vLLM fails at the first request or never), and a field equal to
transformers' own default (``top_k: 50``) is applied as written (vLLM
drops those, through ``GenerationConfig.to_diff_dict``).

Imports only the standard library, structlog, ``kvserve.config`` (where
``GenerationDefaults`` lives, re-exported here) and ``kvserve.core``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

from kvserve.config import GENERATION_CONFIG_KEYS, GenerationDefaults
from kvserve.core.sampling_params import SamplingParams

#: The file's name, in a checkpoint folder or the folder ``--generation-config`` names.
GENERATION_CONFIG_FILE = "generation_config.json"
#: ``--generation-config`` values that name no folder.
AUTO, VLLM = "auto", "vllm"
#: generation_config.json key -> SamplingParams field.
_KEYS = GENERATION_CONFIG_KEYS
_INT_KEYS = ("top_k", "max_new_tokens")

_log = structlog.get_logger("kvserve.model")


class GenerationConfigError(ValueError):
    """A ``--generation-config`` setting or a ``generation_config.json``
    kvserve cannot use; the message names the file (and the key) and what
    is accepted, on one line."""


#: No defaults (``--generation-config vllm``, or a model without the file).
NO_DEFAULTS = GenerationDefaults()


def read_generation_config(path: str | Path, cap_max_tokens: bool = False) -> GenerationDefaults:
    """Parse one ``generation_config.json`` into ``GenerationDefaults``.

    Keys other than the sampling ones (module doc) are ignored; a null
    value counts as absent. Each value must be a JSON number (an integer
    for ``top_k`` and ``max_new_tokens``) in the range ``SamplingParams``
    allows: temperature >= 0, top_p in (0, 1], top_k >= -1, min_p in
    [0, 1], repetition_penalty >= 0.01, max_new_tokens >= 1.

    Raises:
        GenerationConfigError: the file cannot be read, is not a JSON
            object, or holds a bad value; the message names the file and key.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise GenerationConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise GenerationConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: must hold a JSON object, got "
                                    f"{type(data).__name__}")
    found: dict[str, float | int] = {}
    for key, name in _KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        found[name] = _checked(path, key, value)
    try:
        SamplingParams(**{"max_tokens": None, **found})
    except ValueError as exc:
        message = str(exc)
        if message.startswith("max_tokens"):
            message = "max_new_tokens" + message[len("max_tokens"):]
        raise GenerationConfigError(f"{path}: {message}") from None
    return GenerationDefaults(**found, source=str(path), cap_max_tokens=cap_max_tokens)


def _checked(path: Path, key: str, value: Any) -> float | int:
    """``value`` if it is a JSON number of ``key``'s kind, else GenerationConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GenerationConfigError(f"{path}: {key} must be a number, got {value!r}")
    if key in _INT_KEYS and not (isinstance(value, int) or value.is_integer()):
        raise GenerationConfigError(f"{path}: {key} must be an integer, got {value!r}")
    return int(value) if key in _INT_KEYS else float(value)


def resolve_generation_defaults(model: str | Path, setting: str = AUTO) -> GenerationDefaults:
    """The defaults ``--generation-config setting`` gives a server of ``model``.

    Args:
        model: the checkpoint folder (``EngineConfig.model``).
        setting: ``auto`` (the model folder's file, if it has one), ``vllm``
            (none) or a folder holding ``generation_config.json`` (whose
            ``max_new_tokens`` then caps every request; module doc). A path
            to the file itself is taken too.

    Returns:
        ``NO_DEFAULTS`` when there is no file to read, else the file's.

    Raises:
        GenerationConfigError: a folder setting that does not exist or lacks
            the file, or a file ``read_generation_config`` refuses.
    """
    if setting == VLLM:
        return NO_DEFAULTS
    if setting == AUTO:
        path = Path(model) / GENERATION_CONFIG_FILE
        return read_generation_config(path) if path.is_file() else NO_DEFAULTS
    given = Path(setting).expanduser()
    if given.is_file():
        return read_generation_config(given, cap_max_tokens=True)
    if not given.is_dir():
        raise GenerationConfigError(
            f"--generation-config {setting}: no such folder; give auto (the model's own "
            f"{GENERATION_CONFIG_FILE}), vllm (none) or a folder holding {GENERATION_CONFIG_FILE}")
    path = given / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise GenerationConfigError(
            f"--generation-config {setting}: the folder has no {GENERATION_CONFIG_FILE}; give "
            f"auto, vllm or a folder holding one")
    return read_generation_config(path, cap_max_tokens=True)


def describe(defaults: GenerationDefaults) -> str:
    """``"temperature=0.2, top_p=0.9"``, or ``"none"`` when nothing is set."""
    values = defaults.values()
    return ", ".join(f"{name}={value:g}" for name, value in values.items()) if values else "none"


def log_generation_defaults(defaults: GenerationDefaults, setting: str = AUTO) -> None:
    """Log the ``generation_defaults`` info event once at start-up: the
    values applied to requests that omit them (``values``, ``"none"`` when
    there are none), the file (``source``) and the ``--generation-config``
    setting, with a sentence saying how to turn them off (vLLM's start-up
    warning says the same)."""
    values = defaults.values()
    if values:
        cap = (" and caps max_tokens at its max_new_tokens" if defaults.cap_max_tokens
               and defaults.max_tokens is not None else "")
        message = (f"Default sampling parameters from {defaults.source}: {describe(defaults)}; "
                   f"applied when a request omits them{cap} (--generation-config vllm: none)")
    else:
        why = "--generation-config vllm" if setting == VLLM else "no generation_config.json"
        message = (f"No default sampling parameters ({why}): a request that omits them gets "
                   "temperature 1.0, top_p 1.0, no top_k, min_p or repetition penalty")
    _log.info("generation_defaults", values=values or "none", source=defaults.source,
              generation_config=setting, message=message)


