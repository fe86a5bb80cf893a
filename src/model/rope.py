"""RoPE settings of a checkpoint, read once for every family, and their cos/sin table.

A Hugging Face ``config.json`` gives RoPE in one of two forms:

- transformers 4: ``rope_theta`` at the top level and, for a scaled RoPE,
  ``rope_scaling: {"rope_type" (or "type"), "factor", ...}``;
- transformers 5: ``rope_parameters: {"rope_theta", "rope_type", ...}``, or
  one such dict per attention type (``{"full_attention": {...},
  "sliding_attention": {...}}``, Gemma 3).

:func:`read_rope` turns either into a :class:`RopeSpec`; a type kvserve does
not compute (``dynamic``, or anything unknown) raises ``ValueError`` naming
the key, so that no checkpoint is served with a RoPE it does not have.
:func:`rope_table` turns a spec into the float32 ``[max_position, head_dim]``
cos/sin table every backend's RoPE reads (``ops.build_rope_cache``'s layout).

The frequencies follow transformers' ``modeling_rope_utils``
(``_compute_*_parameters``, 5.25), which follow the papers: ``linear``
(position interpolation, kaiokendev), ``llama3`` (Meta's Llama 3.1
smoothing between ``low_freq_factor`` and ``high_freq_factor``), ``yarn``
(Peng et al. 2023, arXiv:2309.00071: ramp between interpolation and
extrapolation, cos/sin times ``attention_factor``) and ``longrope`` (Phi-3:
per-frequency ``short_factor`` / ``long_factor``, cos/sin times
``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``). A GGUF's
``rope_freqs`` tensor (llama.cpp's ``freq_factors``: each frequency divided
by its factor) is the ``freq_factors`` of a ``default`` spec (the converted
config's ``rope_freq_factors``).

LongRoPE: transformers switches every position of a forward to
``long_factor`` once the sequence exceeds ``original_max_position_embeddings``
(and its cache then holds keys rotated with the other factors); the table
here uses ``short_factor`` below that position and ``long_factor`` from it,
so that a position's rotation never depends on the batch (vLLM switches per
batch). Below the original context, both agree exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from kvserve.config import RopeSpec  # its home is config (ModelConfig's field); re-exported

#: The ``rope_type`` s :func:`rope_table` computes.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
#: Keys of a ``rope_scaling`` / ``rope_parameters`` dict that change nothing
#: here (``type`` is the old name of ``rope_type``; ``mrope_section`` only
#: matters for multimodal position ids, never given to a text model).
_IGNORED_KEYS = {"type", "rope_type", "rope_theta"}
#: Keys each type reads; any other key in the dict is refused.
_TYPE_KEYS = {
    "default": {"partial_rotary_factor"},
    "linear": {"factor", "partial_rotary_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings", "partial_rotary_factor"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "original_max_position_embeddings", "truncate",
             "partial_rotary_factor"},
    "longrope": {"factor", "attention_factor", "short_factor", "long_factor",
                 "original_max_position_embeddings", "partial_rotary_factor"},
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1; paper eq. 21)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def read_rope(cfg: dict[str, Any], where: str, layer_type: str = "full_attention",
              default_theta: float = 10000.0) -> RopeSpec:
    """The :class:`RopeSpec` of ``cfg`` (a ``config.json`` dict) for ``layer_type``.

    Reads ``rope_parameters`` (transformers 5; per attention type when it is
    a dict of dicts), else ``rope_scaling`` with the top-level ``rope_theta``
    (transformers 4); ``original_max_position_embeddings`` at the top level
    (Phi-3) wins over the dict's, as in transformers. ``rope_freq_factors``
    (a key kvserve writes for a GGUF's ``rope_freqs`` tensor) gives a
    ``default`` spec its ``freq_factors``.

    Raises:
        ValueError: naming ``where`` and the key: an unknown or uncomputed
            ``rope_type`` (``dynamic`` among them), a key that type does not
            read (it would change the math unseen), ``partial_rotary_factor``
            other than 1, a missing or non-positive parameter, factor lists
            of the wrong length.
    """
    theta = cfg.get("rope_theta", default_theta)
    params = cfg.get("rope_parameters")
    key = "rope_parameters"
    if isinstance(params, dict) and params and all(isinstance(v, dict) or v is None
                                                  for v in params.values()):
        key = f"rope_parameters[{layer_type!r}]"
        params = params.get(layer_type) or {}
    scaling = cfg.get("rope_scaling") or {}
    if params and scaling and {k: v for k, v in scaling.items() if k != "type"} != {
            k: v for k, v in params.items() if k not in ("type", "rope_theta")}:
        raise ValueError(f"{where}: rope_scaling = {scaling!r} beside {key}: "
                         "which one holds is ambiguous; keep one")
    if not params:
        params, key = scaling, "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{where}: {key} = {params!r} is not an object")
    theta = float(params.get("rope_theta", theta) or default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: {key}.rope_type = {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    unread = sorted(set(params) - _TYPE_KEYS[rope_type] - _IGNORED_KEYS)
    if unread:
        raise ValueError(f"{where}: {key} has {unread[0]!r}, which rope_type {rope_type!r} "
                         "does not read here; refusing rather than ignoring it")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is None:
        partial = 1.0
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"{where}: partial_rotary_factor = {partial!r} must be in (0, 1]")
    spec = _read_type(cfg, params, key, where, theta, rope_type)
    return dataclasses.replace(spec, rotary_fraction=float(partial)) if partial != 1 else spec


def _read_type(cfg: dict[str, Any], params: dict[str, Any], key: str, where: str,
               theta: float, rope_type: str) -> RopeSpec:
    """:func:`read_rope`'s spec of ``rope_type`` (its parameters checked)."""
    if not theta > 0:
        raise ValueError(f"{where}: rope_theta = {theta!r} must be positive")
    factors = cfg.get("rope_freq_factors")
    if factors is not None:
        if rope_type != "default" or not isinstance(factors, list) or not all(
                isinstance(v, (int, float)) and v > 0 for v in factors):
            raise ValueError(f"{where}: rope_freq_factors must be a list of positive numbers, "
                             "beside no other RoPE scaling")
        return RopeSpec(theta, freq_factors=tuple(float(v) for v in factors))
    if rope_type == "default":
        return RopeSpec(theta)

    def number(name: str, default: Any = None) -> float:
        value = params.get(name, default)
        if value is None or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{where}: {key}.{name} = {value!r} must be a positive number")
        return float(value)

    original = int(cfg.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings") or 0)
    if rope_type == "linear":
        return RopeSpec(theta, rope_type, factor=number("factor"))
    if original <= 0:
        raise ValueError(f"{where}: {key} of type {rope_type!r} needs "
                         "original_max_position_embeddings")
    if rope_type == "llama3":
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if high <= low:
            raise ValueError(f"{where}: {key}.high_freq_factor must exceed low_freq_factor")
        return RopeSpec(theta, rope_type, factor=number("factor"), original_max_position=original,
                        low_freq_factor=low, high_freq_factor=high)
    if rope_type == "yarn":
        factor = (number("factor") if params.get("factor") is not None
                  else cfg.get("max_position_embeddings", original) / original)
        attention = params.get("attention_factor")
        if attention is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                         if mscale and mscale_all else _yarn_mscale(factor))
        return RopeSpec(theta, rope_type, factor=factor, original_max_position=original,
                        beta_fast=float(params.get("beta_fast") or 32),
                        beta_slow=float(params.get("beta_slow") or 1),
                        truncate=bool(params.get("truncate", True)),
                        attention_factor=float(attention))
    # longrope
    short, long = params.get("short_factor"), params.get("long_factor")
    for name, value in (("short_factor", short), ("long_factor", long)):
        if not isinstance(value, list) or not value or not all(
                isinstance(v, (int, float)) and v > 0 for v in value):
            raise ValueError(f"{where}: {key}.{name} must be a list of positive numbers")
    factor = (number("factor") if params.get("factor") is not None
              else cfg.get("max_position_embeddings", original) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeSpec(theta, rope_type, factor=float(factor), original_max_position=original,
                    attention_factor=float(attention), short_factor=tuple(map(float, short)),
                    long_factor=tuple(map(float, long)))


def inverse_frequencies(spec: RopeSpec, head_dim: int, long: bool = False) -> np.ndarray:
    """float64[head_dim / 2]: the rotation per position of each frequency pair.

    ``long``: ``longrope``'s long factors (else its short ones). With a
    partial rotary (``rotary_fraction``), the frequencies of the rotary
    dimensions (computed over them, as transformers does), then zeros for
    the pairs that pass. Raises ValueError when ``short_factor`` /
    ``long_factor`` / ``freq_factors`` do not have one entry per rotary pair."""
    rot = spec.rotary_dim(head_dim)
    freqs = _rotary_frequencies(spec, rot, long)
    if rot == head_dim:
        return freqs
    return np.concatenate([freqs, np.zeros((head_dim - rot) // 2)])  # pass-through pairs


def _rotary_frequencies(spec: RopeSpec, head_dim: int, long: bool) -> np.ndarray:
    """:func:`inverse_frequencies` over the ``head_dim`` rotary dimensions."""
    half = head_dim // 2
    base = 1.0 / spec.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = spec.rope_type
    if kind == "default":
        if not spec.freq_factors:
            return base
        return base / _factors(spec.freq_factors, half, "freq_factors")
    if kind == "linear":
        return base / spec.factor
    if kind == "llama3":
        old = spec.original_max_position
        low_wavelen = old / spec.low_freq_factor
        high_wavelen = old / spec.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = np.where(wavelen > low_wavelen, base / spec.factor, base)
        smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor
                                                           - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
    if kind == "yarn":
        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(spec.original_max_position / (rotations * 2 * math.pi))
                    / (2 * math.log(spec.theta)))
        low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
        if spec.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return base / spec.factor * (1 - extrapolation) + base * extrapolation
    factors = spec.long_factor if long else spec.short_factor
    return base / _factors(factors, half, "long_factor" if long else "short_factor")


def _factors(values: tuple[float, ...], half: int, name: str) -> np.ndarray:
    if len(values) != half:
        raise ValueError(f"RoPE {name} has {len(values)} entries for head_dim / 2 = {half}")
    return np.asarray(values, dtype=np.float64)


def rope_table(spec: RopeSpec, head_dim: int, max_position: int) -> np.ndarray:
    """float32[max_position, head_dim]: row p is ``a * [cos(p f_0) .. cos(p f_{h-1}),
    sin(p f_0) .. sin(p f_{h-1})]`` with ``f`` = :func:`inverse_frequencies`
    and ``a`` the spec's ``attention_factor`` (transformers multiplies cos and
    sin by it). ``longrope``: short factors for positions below
    ``original_max_position``, long ones from it. Angles in float64.

    Raises ValueError for an odd or non-positive ``head_dim``, a
    non-positive ``max_position``, factor lists of the wrong length."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_table: head_dim must be positive and even, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"rope_table: max_position must be positive, got {max_position}")
    positions = np.arange(max_position, dtype=np.float64)[:, None]
    angles = positions * inverse_frequencies(spec, head_dim)[None, :]
    if spec.rope_type == "longrope" and max_position > spec.original_max_position:
        cut = spec.original_max_position
        angles[cut:] = positions[cut:] * inverse_frequencies(spec, head_dim, long=True)[None, :]
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
    if spec.attention_factor != 1.0:  # the rotary pairs only; a passing one stays (1, 0)
        pairs = spec.rotary_dim(head_dim) // 2
        half = head_dim // 2
        table[:, :pairs] *= spec.attention_factor
        table[:, half:half + pairs] *= spec.attention_factor
    return table.astype(np.float32)


def partial_rotary_perm(num_heads: int, head_dim: int, rotary_dim: int) -> np.ndarray:
    """int64[num_heads * head_dim]: the row order of a q or k projection that
    lets a whole-head RoPE kernel compute a partial one.

    The kernels rotate pairs ``(i, i + head_dim / 2)`` with the table's pair
    ``i``; transformers rotates pairs ``(j, j + rotary_dim / 2)`` of the first
    ``rotary_dim`` dimensions and passes the rest. Within each head, row
    ``new`` takes row ``order[new]``: rotary pair j at ``(j, j + head_dim /
    2)``, the passing dimensions in the other places, whose table pairs
    (zero frequency) leave them as they are. q and k take the same order,
    so every q.k product is unchanged; v and the output projection are not
    touched."""
    half, rhalf = head_dim // 2, rotary_dim // 2
    passing = np.arange(rotary_dim, head_dim)
    first, second = passing[:half - rhalf], passing[half - rhalf:]
    order = np.concatenate([np.arange(rhalf), first, np.arange(rhalf, rotary_dim), second])
    return (np.arange(num_heads)[:, None] * head_dim + order[None, :]).reshape(-1)


def qk_row_orders(config: Any) -> dict[str, np.ndarray] | None:
    """The row orders that give a partial rotary (``partial_rotary_factor``,
    Phi-4-mini) to the whole-head RoPE kernels (:func:`partial_rotary_perm`)
    for ``config`` (a ``ModelConfig``):
    ``{"q_proj", "k_proj", "q_norm", "k_norm"}`` (norms: one head's order),
    or None for a RoPE over whole heads."""
    spec, hd = config.rope, config.head_dim
    if spec.rotary_fraction == 1.0:
        return None
    rot = spec.rotary_dim(hd)
    return {"q_proj": partial_rotary_perm(config.num_attention_heads, hd, rot),
            "k_proj": partial_rotary_perm(config.num_key_value_heads, hd, rot),
            "q_norm": partial_rotary_perm(1, hd, rot), "k_norm": partial_rotary_perm(1, hd, rot)}


def row_order_of(name: str, orders: dict[str, np.ndarray] | None) -> np.ndarray | None:
    """``qk_row_orders``' order for HF tensor ``name`` (a q/k projection's
    weight or bias, a q/k norm), or None."""
    if orders is None or ".self_attn." not in name:
        return None
    return orders.get(name.split(".self_attn.")[1].split(".")[0])
