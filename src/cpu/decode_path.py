"""The fused CPU decode step: when it applies, and the checks before the kernel.

``CpuOps.decode_layers`` (called by ``LlamaModel.hidden_states``) hands a
step of short queries here (decode, speculative verification);
:func:`decode_layers` runs every decoder layer in
``kvserve.cpu.decode_layer.decode_layers`` (one compiled call for the step)
and returns ``(x, residual)``, or None where the op-by-op path must run:

- ``KVSERVE_CPU_FUSED_DECODE=0`` in the environment when ``CpuOps`` was
  made (``=layer``: one compiled call per layer instead of one per step,
  for measurement); with the architecture and weight checks below, that
  is decided once per model (:func:`choose`: ``LlamaModel.decode_path``),
  the others at each step;
- a sequence with more than ``MAX_QUERY_TOKENS`` new tokens (a prompt
  chunk), or more tokens in all than ``DENSE_MAX_SEQS`` (float32 weights: the
  op path moves to BLAS sgemm there) or ``BLOCK_MAX_SEQS`` (GGUF blocks).
  A sequence of several new tokens (a speculative verification, a short
  chunk) is given one row per token, with its sequence's block table and
  its own causal context length, so the kernel sees one-token rows;
- a layer weight other than float32 dense, a q4 / q8 ``BlockQuantizedWeight``
  or a ``KQuantWeight`` (int8, w8a8), a q/k/v ``StackedWeight`` of more than
  three parts, shapes that are not the model's, or, with K-quants, a product
  whose N is not a whole number of ``KLANES`` panels;
- an architecture the fused kernel does not compute (:func:`fused_architecture`:
  Gemma 3's sliding windows, q/k norms, sandwich norms or GeGLU);
- ``attn`` given per KV-cache group (a sequence of metadata) rather than one;
- KV caches that are not all float32 or all int8 (``--kv-cache-dtype
  int8``: the kernel then also gets their float32 views, the scales'),
  or not of the model's shape;
- metadata the op path's kernels would reject (a position outside the RoPE
  table, a slot beyond the cache, a block id out of range, a block table
  too narrow): the op path then raises its own error.

The layer tuples and the typed list of KV caches are built once per model
and per cache list (a weak cache on the model), so a step costs the checks
of its S-element metadata arrays and one call.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np

from kvserve.cpu import decode_layer as dl
from kvserve.cpu import block_dot_ops, kquant_kernels
from kvserve.cpu import panel_kernels as pk
from kvserve.cpu.kquant_kernels import KLANES
from kvserve.cpu.block_dot_ops import Q8_MAX_ROWS
from kvserve.cpu.block_ops import check_weight
from kvserve.cpu.parallel import PARALLEL_REGION
from kvserve.model import kv_quant
from kvserve.model.ggml_blocks import BlockQuantizedWeight, KQuantWeight, StackedWeight
from kvserve.model.ops import DecodePath

#: Environment switch: ``0`` turns the fused path off, ``layer`` makes it
#: one compiled call per layer (default: one per step).
ENV = "KVSERVE_CPU_FUSED_DECODE"
#: Most sequences of a fused step with float32 weights (``ops.DENSE_GEMV_MAX_ROWS``:
#: above it the op path's products are BLAS sgemm).
DENSE_MAX_SEQS = 12
#: Most sequences of a fused step with GGUF block weights (``block_ops.GEMV_MAX_ROWS``).
BLOCK_MAX_SEQS = 256
#: Most new tokens of one sequence in a fused step: a speculative verification
#: (``num_speculative_tokens`` + 1) or a short prompt chunk, each token a row
#: of its own with its causal context. Longer chunks take the op path's tiled
#: prefill attention, which reads each K/V block once for a tile of queries.
MAX_QUERY_TOKENS = 16

_F32 = np.zeros((1, 1), np.float32)
_U8 = np.zeros((1, 1), np.uint8)
_I8 = np.zeros((1, 1), np.int8)
_NO_BIAS = np.zeros(0, np.float32)
_NO_TILES = np.zeros(1, np.int64)  # ``tiles`` of a step whose sequences have one token each
#: ``decode_layers``' window: the fused step attends over whole contexts only
#: (:func:`fused_architecture`); an int passed at run time, see there.
FULL_ATTENTION = 0
#: The ``qkv2`` / ``qkv3`` of a layer whose q/k/v projection is fewer parts.
_NO_WEIGHT = (dl.NONE, 0, _F32, _U8, _I8, _F32, _F32)


def fused_architecture(config: Any) -> bool:
    """True when the fused kernel computes ``config`` 's layers: Llama's
    (every layer full attention, SwiGLU, two norms a layer, no q/k norm).
    The attention scale, the embedding multiplier (applied before the
    layers) and a norm offset (folded into the weights) do not matter."""
    return (all(t == "full_attention" for t in getattr(config, "layer_types", ()))
            and getattr(config, "hidden_activation", "silu") == "silu"
            and not getattr(config, "qk_norm", False)
            and not getattr(config, "sandwich_norms", False))


class _Prepared:
    """A model's layers as kernel tuples (``layers``: typed List), or
    ``layers`` None when some weight, or the architecture, has no fused form."""

    def __init__(self, model: Any) -> None:
        self.layer_objs = list(model.layers)
        self.rope = model.rope_cache
        self.dense = False
        self.caches: tuple = ()
        self.cache_list = None
        self.scale_list = None
        cfg = model.config
        self.nh, self.nkv, self.hd = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                      cfg.head_dim)
        self.eps = float(cfg.rms_norm_eps)
        self.act_q8 = False  # set by _weight: a block weight with Q8 activations
        self.act_qk = False  # set by _weight: a K-quant weight (Q8_K activations)
        # w4a8's q4 weights as panels of LANES channels: every product's N,
        # and each half of gate_up, a whole number of panels
        hd, inter = cfg.head_dim, cfg.intermediate_size
        self.panels_ok = pk.HAS_PANELS and all(n % pk.LANES == 0 for n in (
            cfg.hidden_size, inter, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd))
        # K-quant products run in whole panels of KLANES channels
        self.kquant_ok = all(n % KLANES == 0 for n in (
            cfg.hidden_size, inter, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd))
        self.scale = np.float32(model.scale)
        self.layers = None
        if not fused_architecture(cfg):
            return
        tuples = [self._layer(layer, cfg) for layer in self.layer_objs]
        ok = (all(t is not None for t in tuples) and len(tuples) > 0
              and _f32(self.rope, 2) and self.rope.shape[1] == self.hd and self.hd % 2 == 0
              and self.nh % self.nkv == 0)
        if ok:
            self.layers = dl.typed_list(tuples)

    def _layer(self, layer: Any, cfg: Any) -> tuple | None:
        H, hd = cfg.hidden_size, cfg.head_dim
        n_qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
        inter = cfg.intermediate_size
        parts = layer.qkv.parts if isinstance(layer.qkv, StackedWeight) else (layer.qkv,)
        if len(parts) > 3 or sum(p.shape[0] for p in parts) != n_qkv:
            return None
        shapes = ((parts[0], parts[0].shape[0], H),
                  (layer.o_proj, H, cfg.num_attention_heads * hd),
                  (layer.gate_up, 2 * inter, H), (layer.down, H, inter),
                  *((p, p.shape[0], H) for p in parts[1:]))
        weights = [self._weight(w, n, k) for w, n, k in shapes]
        norms_ok = all(_f32(a, 1) and a.shape == (H,)
                       for a in (layer.input_norm, layer.post_norm))
        bias = _NO_BIAS if layer.qkv_bias is None else layer.qkv_bias
        if any(w is None for w in weights) or not norms_ok or not _f32(bias, 1) \
                or (layer.qkv_bias is not None and bias.shape != (n_qkv,)):
            return None
        if self.act_qk and not (self.kquant_ok and all(p.shape[0] % KLANES == 0
                                                       for p in parts)):
            return None
        qkv, o_proj, gate_up, down = weights[:4]
        second, third = (weights[4:] + [_NO_WEIGHT, _NO_WEIGHT])[:2]
        return (layer.input_norm, layer.post_norm, qkv, bias, o_proj, gate_up, down, second,
                third)

    def _weight(self, w: Any, n: int, k: int) -> tuple | None:
        if isinstance(w, KQuantWeight):
            if w.shape != (n, k) or w.codes is None or n % KLANES:
                return None
            self.act_qk = True
            kind = dl.KQ4_K + kquant_kernels.KIND_OF[w.ggml_type]
            mins = _F32 if w.ggml_type == "Q6_K" else w.mins.view(np.float32)
            return (kind, n, w.dd, w.codes, w.scales.view(np.int8), _F32, mins)
        if isinstance(w, np.ndarray):
            if not _f32(w, 2) or w.shape != (n, k):
                return None
            self.dense = True
            return (dl.DENSE, n, w, _U8, _I8, _F32, _F32)
        if isinstance(w, BlockQuantizedWeight):
            try:
                check_weight(w)
            except ValueError:
                return None
            if w.shape != (n, k) or not all(a.flags.writeable for a in (w.qs, w.d)) \
                    or (w.m is not None and not w.m.flags.writeable):
                return None
            self.act_q8 |= w.activations == "q8"
            if w.kind == "q4" and w.activations == "q8" and self.panels_ok:
                packed, dpm = block_dot_ops.panels_of(w)
                return (dl.Q4P, n, dpm, w.qs, packed.view(np.int8), w.d, w.m)
            if w.kind == "q4":
                return (dl.Q4, n, _F32, w.qs, _I8, w.d, w.m)
            return (dl.Q8, n, _F32, _U8, w.qs, w.d, _F32)
        return None

    def matches(self, model: Any) -> bool:
        """Still the model's layers (a test may swap weights in place)."""
        layers = model.layers
        return (len(layers) == len(self.layer_objs) and model.rope_cache is self.rope
                and all(a is b for a, b in zip(layers, self.layer_objs)))

    def cache_list_for(self, kv_caches: list) -> tuple[Any, Any]:
        """``(caches, scales)``: the typed List of ``kv_caches`` and None, or
        for int8 caches also the typed List of their float32 views
        (``kv_quant``: the scales); ``(None, None)`` when one is not a
        writeable C-contiguous float32 [num_blocks, 2, block_size, nkv, hd]
        (or int8 [..., hd + 4]) of the first one's shape and dtype. Rebuilt
        when the list changes."""
        if len(kv_caches) == len(self.caches) and all(
                a is b for a, b in zip(kv_caches, self.caches)):
            return self.cache_list, self.scale_list
        first = kv_caches[0] if kv_caches else None
        shape = getattr(first, "shape", None)
        dtype = getattr(first, "dtype", None)
        width = self.hd + 4 if dtype == np.int8 else self.hd
        ok = (len(kv_caches) == len(self.layer_objs) and shape is not None and len(shape) == 5
              and dtype in (np.float32, np.int8) and shape[1] == 2 and shape[3] == self.nkv
              and shape[4] == width and (dtype == np.float32 or self.hd % 4 == 0)
              and all(isinstance(c, np.ndarray) and c.dtype == dtype and c.shape == shape
                      and c.flags.c_contiguous and c.flags.writeable for c in kv_caches))
        typed = scales = None
        if ok:
            typed = dl.typed_list(list(kv_caches))
            if dtype == np.int8:
                scales = dl.typed_list([c.view(np.float32) for c in kv_caches])
        self.caches, self.cache_list, self.scale_list = tuple(kv_caches), typed, scales
        return typed, scales


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _f32(a: Any, ndim: int) -> bool:
    return (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == ndim
            and a.flags.c_contiguous and a.flags.writeable)


def _prepared(model: Any) -> _Prepared | None:
    prep = _PREPARED.get(model)
    if prep is None or not prep.matches(model):
        try:
            prep = _Prepared(model)
        except (AttributeError, TypeError):
            return None
        _PREPARED[model] = prep
    return prep if prep.layers is not None else None


def _int(a: Any, dtype: type) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=dtype)
    return a if a.flags.writeable else a.copy()


#: What ``KVSERVE_CPU_FUSED_DECODE`` may be: one compiled call a step, the
#: op path, one compiled call a layer.
MODES = ("1", "0", "layer")


def mode_from_env() -> str:
    """``KVSERVE_CPU_FUSED_DECODE`` (read once, by ``CpuOps``), ``"1"`` when
    unset. Raises ValueError for a value not in ``MODES``."""
    mode = os.environ.get(ENV, "1")
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def choose(model: Any, mode: str, batch_invariant: bool = False) -> DecodePath:
    """The path of ``model`` 's decode steps on the CPU backend with ``mode``
    (``MODES``), and why: ``ops`` when the mode says so, under tensor
    parallelism (its all-reduces come between the products), for an
    architecture the fused kernel does not compute, or for a weight of a
    kind it does not take; ``fused`` otherwise."""
    if mode == "0":
        return DecodePath("ops", f"{ENV}=0")
    if getattr(model, "all_reduce", None) is not None:
        return DecodePath("ops", "tensor parallelism: its all-reduces come between the products")
    if not fused_architecture(model.config):
        return DecodePath("ops", "the architecture: sliding windows, q/k norms, sandwich norms "
                                 "or GeGLU are not in the fused kernel")
    prep = _prepared(model)
    if prep is None:
        return DecodePath("ops", "a layer's weights are of a kind the fused kernel does not take")
    most = DENSE_MAX_SEQS if prep.dense and not batch_invariant else BLOCK_MAX_SEQS
    per = "a compiled call per layer" if mode == "layer" else "one compiled call"
    return DecodePath("fused", f"{per} for a step of at most {most} sequences of at most "
                               f"{MAX_QUERY_TOKENS} new tokens each; other steps op by op")


def decode_layers(hidden: np.ndarray, model: Any, positions: Any, attn: Any,
                  kv_caches: list, num_threads: int, batch_invariant: bool = False,
                  x: np.ndarray | None = None, mode: str = "1"
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """All decoder layers of a step of short queries, fused; None where the op path runs.

    Args:
        hidden: float32[S, H], the embeddings of the step's S tokens.
        model: the ``LlamaModel`` (config, layers, rope_cache, scale).
        positions, attn: as ``LlamaModel.hidden_states``.
        kv_caches: one cache per layer; written at ``attn.slot_mapping``.
        num_threads: Numba threads (``CpuOps._threads()``, already applied):
            the output-channel ranges of each product.
        batch_invariant: ``CpuOps.batch_invariant``: the op path's products
            are per-row kernels at any row count, so float32 weights stay
            fused up to ``BLOCK_MAX_SEQS`` too (the fused kernel sums each
            row as they do).
        x: None on the first pipeline stage; on a later one float32[S, H],
            the previous stage's last MLP output, added to ``hidden`` (then
            the residual stream) before the first layer here.
        mode: ``CpuOps.fused_decode`` (``MODES``): ``"layer"`` makes a
            compiled call per layer, ``"0"`` returns None.

    Returns:
        ``(x, residual)`` float32[S, H]: the last layer's MLP output and the
        residual stream before the final norm (``hidden`` is the residual
        buffer, updated in place, as on the op path).
    """
    if mode == "0" or not hasattr(attn, "seq_lens"):
        return None
    rows = _token_rows(attn)
    if rows is None:
        return None
    bt, sl, tiles = rows
    S = sl.shape[0]
    if getattr(hidden, "shape", None) != (S, model.config.hidden_size):
        return None
    prep = _prepared(model)
    if prep is None or S > (DENSE_MAX_SEQS if prep.dense and not batch_invariant
                            else BLOCK_MAX_SEQS):
        return None
    caches, scales = prep.cache_list_for(kv_caches)
    if caches is None:
        return None
    pos = _int(positions, np.int64)
    slots = _int(attn.slot_mapping, np.int64)
    if not _metadata_ok(pos, slots, bt, sl, S, kv_caches[0].shape, prep.rope.shape[0]):
        return None
    panels = prep.panels_ok and S >= block_dot_ops.PANEL_MIN_ROWS
    act_q8 = prep.act_q8 and (S <= Q8_MAX_ROWS or panels) and not batch_invariant
    # kv_scales, panels and act_qk always given: one signature per cache dtype,
    # as warmup's
    extra = (scales, panels and act_q8, prep.act_qk, tiles is not None,
             _NO_TILES if tiles is None else tiles, FULL_ATTENTION)
    residual = hidden
    if not _f32(residual, 2):
        residual = np.array(hidden, dtype=np.float32, order="C")
    add_first = x is not None
    if add_first:
        if getattr(x, "shape", None) != residual.shape:
            return None
        x = np.array(x, dtype=np.float32, order="C")  # updated in place: never the caller's
    else:
        x = np.empty_like(residual)
    if mode == "layer":
        with PARALLEL_REGION:
            for i in range(len(prep.layer_objs)):
                dl.decode_layers(i, i + 1, x, residual, add_first or i > 0, prep.layers, caches, pos,
                                 prep.rope, slots, bt, sl, prep.eps, prep.scale, prep.nh,
                                 prep.nkv, num_threads, act_q8, batch_invariant, *extra)
    else:
        with PARALLEL_REGION:
            dl.decode_layers(0, len(prep.layer_objs), x, residual, add_first, prep.layers, caches,
                             pos, prep.rope, slots, bt, sl, prep.eps, prep.scale, prep.nh,
                             prep.nkv, num_threads, act_q8, batch_invariant, *extra)
    return x, residual


def _token_rows(attn: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """``(block_tables, seq_lens, tiles)`` per token of the step: int32[T, B]
    and int32[T], each token its sequence's block table and causal context
    (the sequence's ``seq_lens`` less the tokens after it in the step);
    ``tiles`` None when every sequence has one token, else int64[S + 1], the
    rows of each sequence (``query_start_loc``). None where the metadata is
    malformed, or a sequence has no token or more than ``MAX_QUERY_TOKENS``
    (a prompt chunk: the op path's tiled prefill)."""
    sl = np.asarray(attn.seq_lens)
    qsl = np.asarray(attn.query_start_loc)
    bt = np.asarray(attn.block_tables)
    S = sl.shape[0] if sl.ndim == 1 else -1
    if S < 1 or qsl.shape != (S + 1,) or bt.ndim != 2 or bt.shape[0] != S \
            or not np.issubdtype(qsl.dtype, np.integer):
        return None
    if np.array_equal(qsl, np.arange(S + 1)):
        return _int(bt, np.int32), _int(sl, np.int32), None
    q_lens = np.diff(qsl)
    if qsl[0] != 0 or q_lens.min() < 1 or q_lens.max() > MAX_QUERY_TOKENS:
        return None
    seq_of = np.repeat(np.arange(S), q_lens)
    after = qsl[1:][seq_of] - 1 - np.arange(seq_of.shape[0])  # tokens after each in its sequence
    return (np.ascontiguousarray(bt[seq_of], np.int32),
            np.ascontiguousarray(sl[seq_of] - after, np.int32), _int(qsl, np.int64))


def _metadata_ok(pos: np.ndarray, slots: np.ndarray, bt: np.ndarray, sl: np.ndarray, S: int,
                 cache_shape: tuple, max_pos: int) -> bool:
    """What the op path's kernels check, for the fused kernel (which does not)."""
    nb, bs = cache_shape[0], cache_shape[2]
    if pos.shape != (S,) or slots.shape != (S,) or bt.ndim != 2 or bt.shape[0] != S:
        return False
    if pos.min() < 0 or pos.max() >= max_pos or slots.max() >= nb * bs or sl.min() < 1:
        return False
    needed = (sl.astype(np.int64) + bs - 1) // bs
    if needed.max() > bt.shape[1]:
        return False
    used = bt[np.arange(bt.shape[1])[None, :] < needed[:, None]]
    return bool(used.min() >= 0 and used.max() < nb)


def warmup(kv_cache_dtype: str = "auto") -> None:
    """Compile (or load from Numba's cache) the fused kernel on a tiny layer of
    every weight form, so that the first decode step does not pay JIT time,
    for KV caches of ``kv_cache_dtype`` (``auto``: float32; ``int8``)."""
    H, nh, nkv, hd, bs = 32, 2, 1, 16, 4
    rng = np.random.default_rng(0)

    def dense(n: int) -> tuple:
        return (dl.DENSE, n, rng.standard_normal((n, H), dtype=np.float32), _U8, _I8, _F32, _F32)

    ones = np.ones((H, 1), np.float32)
    q4 = (dl.Q4, H, _F32, np.zeros((H, H // 2), np.uint8), _I8, ones, ones)
    q8 = (dl.Q8, H, _F32, _U8, np.ones((H, H), np.int8), ones, _F32)
    layers = dl.typed_list([(np.ones(H, np.float32), np.ones(H, np.float32),
                              dense((nh + 2 * nkv) * hd), _NO_BIAS, q4, dense(2 * H), q8,
                              _NO_WEIGHT, _NO_WEIGHT)])
    int8 = kv_quant.is_quantized(kv_quant.check_kv_cache_dtype(kv_cache_dtype))
    cache = (np.zeros((2, 2, bs, nkv, hd + kv_quant.SCALE_BYTES), np.int8) if int8
             else np.zeros((2, 2, bs, nkv, hd), np.float32))
    caches = dl.typed_list([cache])
    extra = (dl.typed_list([cache.view(np.float32)]) if int8 else None, False, False, False,
             _NO_TILES, FULL_ATTENTION)
    x = np.ones((1, H), np.float32)
    with PARALLEL_REGION:
        dl.decode_layers(0, 1, x, x.copy(), False, layers, caches, np.zeros(1, np.int64),
                         np.ones((4, hd), np.float32), np.zeros(1, np.int64),
                         np.zeros((1, 2), np.int32), np.ones(1, np.int32), 1e-5,
                         np.float32(0.25), nh, nkv, 1, True, False, *extra)
