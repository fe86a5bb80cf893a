"""Numba kernel of a fused CPU decode step: whole decoder layers in one compiled call.

A batch of one-token rows (a decode step; or a verification step whose
sequences ``decode_path`` has split into a row per token, ``rows_share``) runs the
layers ``[l0, l1)`` of the model in :func:`decode_layers`, one call for the
step (or one per layer): per layer (residual add +) RMSNorm, the QKV product
(+ bias), NeoX RoPE, the K/V write into the paged cache, paged attention
(GQA), the output product, residual add + RMSNorm, the gate/up product,
SiLU-and-mul and the down product. The op-by-op path
(``LlamaModel.hidden_states`` over ``CpuOps``) makes about eight Python-level
op calls per layer, each with its own checks, allocations and compiled-call
entry; this one makes none (``kvserve.cpu.decode_path`` checks the step's
metadata once, before the call).

The products call the op path's own range kernels (``kernels.f32_gemv_range``,
``block_kernels.q4_gemv_range`` / ``q8_gemv_range``) on the same rows, and the
attention its ``kernels._attend_tile``, so each output channel is summed in
the same order as there; norms, RoPE and SiLU repeat the op kernels'
arithmetic. The result equals the op path's, up to what LLVM does
differently when it inlines the helpers (measured: identical greedy tokens).

With ``act_q8`` (``--quantization w4a8``) each block product's input is
first quantized to Q8 blocks (``block_dot_kernels.quantize_q8_blocks``, once
per product, before its parallel region) and the products are the integer
kernels ``q4_1_q8_gemv_range`` / ``q8_0_q8_gemv_range`` that
``block_dot_ops.linear_blocks_q8`` runs on the op path, or for ``Q4P``
weights with ``panels`` the panels of ``panel_kernels.LANES`` channels
(``panel_kernels.panel_q8_range``), as that op path does on a CPU with
their dot product; the chunks are then whole panels. With ``per_row``
(``--batch-invariant``) dense products take ``f32_gemv_rows_range``, as the
op path then does, so that a row's sums do not depend on the batch.

Parallelism: each product is one ``prange`` over ``n_chunks`` ranges of
whole groups of four output channels (the gate/up product's chunk also
applies SiLU-and-mul to its channels), and RoPE + KV write + attention one
``prange`` over (sequence, KV head): four parallel regions per layer plus
one, which with the OpenMP threading layer cost about 1.3 us each.

Weights, per product, are a 7-tuple ``(kind, N, dense, q4_codes, q8_codes, d,
m)`` (``N`` output channels; ``DENSE``: float32[N, K] ``dense``; ``Q4``: uint8
``q4_codes`` with ``d`` and ``m``; ``Q8``: int8 ``q8_codes`` with ``d``;
``Q4P``: as ``Q4``, plus the packed panels (``block_dot_ops.panels_of``) as
``q8_codes`` (an int8 view) and their scales as ``dense``), the
unused members 1 x 1 placeholders, so that every weight form shares one type and the kernel
compiles once. A layer is the tuple ``(input_norm, post_norm, qkv, qkv_bias,
o_proj, gate_up, down, qkv2, qkv3)``, ``qkv_bias`` float32[0] when the model
has none, ``qkv2`` and ``qkv3`` the second and third parts of a q/k/v
projection held as parts (a K-quant ``StackedWeight``; ``NONE`` tuples
otherwise).

An int8 KV cache (``--kv-cache-dtype int8``, ``kvserve.model.kv_quant``)
comes with the float32 views of the caches (``kv_scales``): the new K/V
vectors are quantized as they are written (``kernels.quantize_kv_vector``,
as ``write_kv`` does) and ``_attend_tile`` dequantizes as it reads; with a
float32 cache ``kv_scales`` is None and those branches are pruned at
compile time.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.typed import List

from kvserve.cpu.block_dot_kernels import (QK, q4_1_q8_gemv_range, q8_0_q8_gemv_range,
                                           quantize_q8_blocks)
from kvserve.cpu.block_kernels import q4_gemv_range, q8_gemv_range
from kvserve.cpu.kernels import (_attend_tile, f32_gemv_range, f32_gemv_rows_range,
                                  quantize_kv_vector)
from kvserve.cpu.kquant_kernels import KLANES, QK_K, kquant_range, quantize_q8_k_rows
from kvserve.cpu.panel_kernels import DOT_FAST, LANES, panel_q8_range
from kvserve.cpu.vector_math import exp_f32

#: Weight kinds of the 7-tuples (``Q4P``: a q4 weight that also carries its
#: panels, ``panel_kernels.pack_panels``; ``KQ4_K`` .. ``KQ6_K``: a K-quant
#: weight's panels, ``kquant_kernels``, whose kind is the tuple's kind less
#: ``KQ4_K``; ``NONE``: no weight, N = 0).
DENSE, Q4, Q8, Q4P, KQ4_K, KQ5_K, KQ6_K, NONE = 0, 1, 2, 3, 4, 5, 6, 7


@njit(nogil=True, cache=True)
def _gemv_range(x, w, out, lo, hi, per_row):
    """out[:, lo:hi] = x @ W[lo:hi].T for a weight 7-tuple ``w``; ``per_row``:
    dense weights take ``f32_gemv_rows_range`` (batch-invariant)."""
    kind, _, dense, q4_codes, q8_codes, d, m = w
    if kind == DENSE and per_row:
        f32_gemv_rows_range(x, dense, out, lo, hi)
    elif kind == DENSE:
        f32_gemv_range(x, dense, out, lo, hi)
    elif kind == Q4 or kind == Q4P:
        q4_gemv_range(x, q4_codes, d, m, out, lo, hi)
    else:
        q8_gemv_range(x, q8_codes, d, out, lo, hi)


@njit(nogil=True, cache=True)
def _q8_operand(x, act_q8, unused):
    """``(xq, xd, xsum)``: float32[S, K] ``x`` in Q8 blocks
    (``block_dot_kernels.quantize_q8_blocks``) when ``act_q8``, else
    ``unused`` (empty placeholders of the same types, made once a call)."""
    S, K = x.shape
    if not act_q8:
        return unused
    xq = np.empty((S, K), np.int8)
    xd = np.empty((S, K // QK), np.float32)
    xsum = np.empty((S, K // QK), np.float32)
    quantize_q8_blocks(x, xq, xd, xsum)
    return xq, xd, xsum


@njit(nogil=True, cache=True)
def _qk_buffers(x, act_qk, unused):
    """``(xq, xd, bsums)``: empty Q8_K buffers for float32[S, K] ``x``
    (``kquant_kernels.quantize_q8_k``) when ``act_qk`` (the model has K-quant
    weights), else ``unused``; ``decode_layers`` fills them a row per
    ``prange`` item (``quantize_q8_k_rows``: a ``prange`` is parallel only in
    the parallel function's own body, not in a helper it calls)."""
    S, K = x.shape
    if not act_qk:
        return unused
    return (np.empty((S, K), np.int8), np.empty((S, K // QK_K), np.float32),
            np.empty((S, K // 16), np.int32))


@njit(nogil=True, cache=True)
def _product_range(x, xq8, act_q8, panels, per_row, w, out, lo, hi, xqk):
    """out[:, lo:hi] = x @ W[lo:hi].T; with ``act_q8`` a block weight takes
    the Q8-activation integer kernels on ``xq8 = _q8_operand(x, True)``,
    a ``Q4P`` one the panels of ``panel_kernels`` when ``panels`` (lo
    and hi then multiples of ``LANES``); a K-quant weight its panels on
    ``xqk``, its Q8_K buffers filled (lo and hi multiples of ``KLANES``)."""
    kind = w[0]
    if kind == NONE:
        return
    if kind >= KQ4_K:
        kquant_range(xqk[0], xqk[1], xqk[2], w[3], w[4].view(np.uint8), w[6].view(np.uint8),
                     w[2], out, lo, hi, kind - KQ4_K, DOT_FAST)
    elif act_q8 and panels and kind == Q4P:
        panel_q8_range(xq8[0], xq8[1], xq8[2], w[4], w[2], out, lo, hi, DOT_FAST)
    elif act_q8 and (kind == Q4 or kind == Q4P):
        q4_1_q8_gemv_range(xq8[0], xq8[1], xq8[2], w[3], w[5], w[6], out, lo, hi)
    elif act_q8 and kind == Q8:
        q8_0_q8_gemv_range(xq8[0], xq8[1], w[4], w[5], out, lo, hi)
    else:
        _gemv_range(x, w, out, lo, hi, per_row)


@njit(nogil=True, cache=True)
def _span(c, n_chunks, n, panels=False, kquants=False):
    """Channels [lo, hi) of chunk c of n, in whole groups of four (of
    ``LANES`` with ``panels``, of ``KLANES`` with ``kquants``), spread evenly."""
    size = KLANES if kquants else (LANES if panels else 4)
    groups = (n + size - 1) // size
    lo = c * groups // n_chunks * size
    hi = min((c + 1) * groups // n_chunks * size, n)
    return lo, hi


@njit(nogil=True, cache=True)
def _add_rms_norm(x, residual, weight, eps, add, out):
    """``residual += x`` when ``add``, then ``out = rms_norm(residual)``: the
    arithmetic of ``kernels.fused_add_rms_norm_kernel`` / ``rms_norm_kernel``
    (sum of squares in float64). x, residual, out: float32[S, H]."""
    S, H = residual.shape
    for t in range(S):
        ss = 0.0
        for i in range(H):
            r = residual[t, i]
            if add:
                r = r + x[t, i]
                residual[t, i] = r
            rd = np.float64(r)
            ss += rd * rd
        inv = np.float32(1.0 / np.sqrt(ss / H + eps))
        for i in range(H):
            out[t, i] = (residual[t, i] * inv) * weight[i]


@njit(nogil=True, cache=True)
def _rope_kv_write(s, kvh, qkv, positions, rope, kv_cache, slots, nh, nkv, kv_scales=None):
    """Row s, KV head kvh: rotate its K and write K/V at ``slots[s]``
    (skipped when negative). ``kv_scales``: None, or an int8 ``kv_cache`` 's
    float32 view: K (rotated first, into a scratch vector) and V are
    quantized as written."""
    hd = rope.shape[1]
    half = hd // 2
    bs = kv_cache.shape[2]
    p = positions[s]
    koff = nh * hd + kvh * hd
    voff = (nh + nkv) * hd + kvh * hd
    slot = slots[s]
    if slot < 0:
        return
    b = slot // bs
    o = slot - b * bs
    if kv_scales is None:
        for i in range(half):
            c = rope[p, i]
            sn = rope[p, half + i]
            k1 = qkv[s, koff + i]
            k2 = qkv[s, koff + half + i]
            kv_cache[b, 0, o, kvh, i] = k1 * c - k2 * sn
            kv_cache[b, 0, o, kvh, half + i] = k2 * c + k1 * sn
        for i in range(hd):
            kv_cache[b, 1, o, kvh, i] = qkv[s, voff + i]
    else:
        k = np.empty(hd, np.float32)
        for i in range(half):
            c = rope[p, i]
            sn = rope[p, half + i]
            k1 = qkv[s, koff + i]
            k2 = qkv[s, koff + half + i]
            k[i] = k1 * c - k2 * sn
            k[half + i] = k2 * c + k1 * sn
        quantize_kv_vector(k, kv_cache[b, 0, o, kvh], kv_scales[b, 0, o, kvh])
        quantize_kv_vector(qkv[s, voff:voff + hd], kv_cache[b, 1, o, kvh],
                           kv_scales[b, 1, o, kvh])


@njit(nogil=True, cache=True)
def _rope_q(s, kvh, qkv, positions, rope, nh, nkv, q):
    """Row s: rotate the query heads of KV group kvh into ``q``."""
    hd = q.shape[2]
    half = hd // 2
    group = nh // nkv
    p = positions[s]
    for g in range(group):
        h = kvh * group + g
        qoff = h * hd
        for i in range(half):
            c = rope[p, i]
            sn = rope[p, half + i]
            q1 = qkv[s, qoff + i]
            q2 = qkv[s, qoff + half + i]
            q[s, h, i] = q1 * c - q2 * sn
            q[s, h, half + i] = q2 * c + q1 * sn


@njit(nogil=True, cache=True)
def _rope_q_attend(s, kvh, qkv, positions, rope, kv_cache, block_tables, seq_lens, scale, nh,
                   nkv, q, att, window, kv_scales=None):
    """Row s, KV head kvh: rotate the group's query heads into ``q`` and
    attend over the row's ``seq_lens[s]`` cached positions into ``att``."""
    _rope_q(s, kvh, qkv, positions, rope, nh, nkv, q)
    _attend_tile(q, kv_cache, block_tables[s], scale, s, 1, seq_lens[s] - 1, kvh, nh // nkv, att,
                 window, kv_scales)


@njit(nogil=True, cache=True)
def _rope_q_attend_tile(t0, t1, kvh, qkv, positions, rope, kv_cache, block_tables, scale, nh,
                        nkv, q, att, window, kv_scales=None):
    """Rows [t0, t1), consecutive tokens of one sequence (positions
    ``positions[t0]`` ..), KV head kvh: rotate their query heads, then one
    causal ``_attend_tile`` over the sequence's blocks, each K/V block read
    once for the whole tile (a verification step's rows)."""
    for s in range(t0, t1):
        _rope_q(s, kvh, qkv, positions, rope, nh, nkv, q)
    _attend_tile(q, kv_cache, block_tables[t0], scale, t0, t1 - t0, positions[t0], kvh,
                 nh // nkv, att, window, kv_scales)


@njit(nogil=True, cache=True)
def _rope_kv_attend(s, kvh, qkv, positions, rope, kv_cache, slots, block_tables, seq_lens,
                    scale, nh, nkv, q, att, window, kv_scales=None):
    """Row s, KV head kvh: :func:`_rope_kv_write`, then :func:`_rope_q_attend`
    (the row's own K/V is the last position it attends to)."""
    _rope_kv_write(s, kvh, qkv, positions, rope, kv_cache, slots, nh, nkv, kv_scales)
    _rope_q_attend(s, kvh, qkv, positions, rope, kv_cache, block_tables, seq_lens, scale, nh,
                   nkv, q, att, window, kv_scales)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def decode_layers(l0, l1, x, residual, add_first, layers, kv_caches, positions, rope, slots,
                  block_tables, seq_lens, eps, scale, nh, nkv, n_chunks, act_q8, per_row,
                  kv_scales, panels, act_qk, rows_share, tiles, window):
    """Layers [l0, l1) of a batch of S one-token rows, in place.

    Args:
        x: float32[S, H], the previous layer's MLP output; on return layer
            ``l1 - 1``'s. Ignored when ``add_first`` is False.
        residual: float32[S, H], the residual stream (``x`` is added to it
            first when ``add_first``; for layer 0 the embeddings, with
            ``add_first`` False).
        layers: a typed List of layer tuples (module docstring), one per layer.
        kv_caches: a typed List of float32[num_blocks, 2, block_size, nkv, hd],
            or of int8[..., hd + 4] (``kvserve.model.kv_quant``).
        positions: int64[S]; rope: float32[max_pos, hd] (``build_rope_cache``);
        slots: int64[S] (negative: not written); block_tables: int32[S, B];
        seq_lens: int32[S], each sequence's context after this step.
        eps, scale: RMSNorm epsilon and attention scale (float32);
        nh, nkv: query and KV heads; n_chunks: output-channel ranges per product.
        act_q8: quantize each block weight's input to Q8 blocks and take the
            integer kernels of ``block_dot_kernels`` (``--quantization
            w4a8``); dense weights keep float activations.
        per_row: dense products by ``kernels.f32_gemv_rows_range``, as the
            op path's when batch-invariant.
        kv_scales: None (float32 caches), or a typed List of the int8 caches'
            float32 views (``cache.view(np.float32)``), one per layer.
        panels: with ``act_q8``, q4 products take the panels
            (``panel_kernels``; the caller checks the CPU, the row count and
            that every q4 weight's N is a multiple of ``LANES``).
        act_qk: the model has K-quant weights (``KQ4_K`` .. ``KQ6_K``): each
            product's input is also quantized to Q8_K, and the chunks are
            whole panels of ``KLANES`` (every N a multiple of it, checked
            by the caller). A layer's ``qkv2`` and ``qkv3`` (its 8th and 9th
            members) are the other parts of a q/k/v projection held as
            parts (``NONE``: none).
        rows_share: some rows are tokens of one sequence (a speculative
            verification or a short prompt chunk: ``decode_path`` gives each
            token its own row, block table and causal context length): every
            row's K/V is written before any row attends, one ``prange`` more
            per layer, and the rows of a sequence attend as one tile
            (``tiles``). False: each row is a sequence of its own, and a row
            writes and attends in one ``prange`` item.
        tiles: with ``rows_share``, int64[n + 1]: sequence i owns rows
            ``tiles[i]:tiles[i + 1]``, consecutive positions (the step's
            ``query_start_loc``); unread otherwise.
        window: every layer's sliding window, 0 (``decode_path`` runs full
            attention only here). A run-time argument, not a literal 0: LLVM
            inlines ``kernels._attend_tile``, and specialized on a constant
            window it vectorized the tile's sums in another order than the
            op path's call, so the fused step's attention no longer equalled
            the op path's bit for bit (and ``--batch-invariant``, which
            mixes the two paths, broke).

    Unchecked: the caller (``decode_path``) checks positions, slots, block
    ids and seq_lens against the cache and the tables. Divisions follow
    NumPy (``error_model="numpy"``: no zero-divisor check, which kept the
    SiLU loop scalar, as in ``kernels.silu_and_mul_kernel``).
    """
    S, H = x.shape
    hd = rope.shape[1]
    n_tiles = tiles.shape[0] - 1 if rows_share else 0
    add = add_first
    xn = np.empty((S, H), np.float32)
    q = np.empty((S, nh, hd), np.float32)
    att = np.empty((S, nh, hd), np.float32)
    no_q8 = (np.empty((0, 0), np.int8), np.empty((0, 0), np.float32),
             np.empty((0, 0), np.float32))
    no_qk = (np.empty((0, 0), np.int8), np.empty((0, 0), np.float32),
             np.empty((0, 0), np.int32))
    for li in range(l0, l1):
        input_norm, post_norm, qkv_w, qkv_bias, o_w, gate_up_w, down_w, qkv2_w, qkv3_w = \
            layers[li]
        kv_cache = kv_caches[li]
        _add_rms_norm(x, residual, input_norm, eps, add, xn)
        add = True

        n_qkv = (nh + 2 * nkv) * hd
        n1, n2, n3 = qkv_w[1], qkv2_w[1], qkv3_w[1]
        qkv = np.empty((S, n_qkv), np.float32)
        second = np.empty((S, n2), np.float32)
        third = np.empty((S, n3), np.float32)
        xq8 = _q8_operand(xn, act_q8, no_q8)
        xqk = _qk_buffers(xn, act_qk, no_qk)
        for r in prange(S if act_qk else 0):
            quantize_q8_k_rows(xn, xqk[0], xqk[1], xqk[2], r, r + 1)
        for c in prange(n_chunks):
            lo, hi = _span(c, n_chunks, n1, panels, act_qk)
            _product_range(xn, xq8, act_q8, panels, per_row, qkv_w, qkv, lo, hi, xqk)
            lo, hi = _span(c, n_chunks, n2, panels, act_qk)
            _product_range(xn, xq8, act_q8, panels, per_row, qkv2_w, second, lo, hi, xqk)
            lo, hi = _span(c, n_chunks, n3, panels, act_qk)
            _product_range(xn, xq8, act_q8, panels, per_row, qkv3_w, third, lo, hi, xqk)
        for t in range(S):
            for n in range(n2):
                qkv[t, n1 + n] = second[t, n]
            for n in range(n3):
                qkv[t, n1 + n2 + n] = third[t, n]
            if qkv_bias.shape[0]:
                for n in range(n_qkv):
                    qkv[t, n] += qkv_bias[n]

        att[:] = 0.0
        if kv_scales is None:
            if rows_share:
                for item in prange(S * nkv):
                    s = item // nkv
                    _rope_kv_write(s, item - s * nkv, qkv, positions, rope, kv_cache, slots,
                                   nh, nkv)
                for item in prange(n_tiles * nkv):
                    i = item // nkv
                    _rope_q_attend_tile(tiles[i], tiles[i + 1], item - i * nkv, qkv, positions,
                                        rope, kv_cache, block_tables, scale, nh, nkv, q, att,
                                        window)
            else:
                for item in prange(S * nkv):
                    s = item // nkv
                    _rope_kv_attend(s, item - s * nkv, qkv, positions, rope, kv_cache, slots,
                                    block_tables, seq_lens, scale, nh, nkv, q, att, window)
        else:
            layer_scales = kv_scales[li]
            if rows_share:
                for item in prange(S * nkv):
                    s = item // nkv
                    _rope_kv_write(s, item - s * nkv, qkv, positions, rope, kv_cache, slots,
                                   nh, nkv, layer_scales)
                for item in prange(n_tiles * nkv):
                    i = item // nkv
                    _rope_q_attend_tile(tiles[i], tiles[i + 1], item - i * nkv, qkv, positions,
                                        rope, kv_cache, block_tables, scale, nh, nkv, q, att,
                                        window, layer_scales)
            else:
                for item in prange(S * nkv):
                    s = item // nkv
                    _rope_kv_attend(s, item - s * nkv, qkv, positions, rope, kv_cache, slots,
                                    block_tables, seq_lens, scale, nh, nkv, q, att, window,
                                    layer_scales)

        att2 = att.reshape(S, nh * hd)
        xq8 = _q8_operand(att2, act_q8, no_q8)
        xqk = _qk_buffers(att2, act_qk, no_qk)
        for r in prange(S if act_qk else 0):
            quantize_q8_k_rows(att2, xqk[0], xqk[1], xqk[2], r, r + 1)
        for c in prange(n_chunks):
            lo, hi = _span(c, n_chunks, H, panels, act_qk)
            _product_range(att2, xq8, act_q8, panels, per_row, o_w, x, lo, hi, xqk)

        _add_rms_norm(x, residual, post_norm, eps, True, xn)

        inter = gate_up_w[1] // 2
        gu = np.empty((S, 2 * inter), np.float32)
        act = np.empty((S, inter), np.float32)
        xq8 = _q8_operand(xn, act_q8, no_q8)
        xqk = _qk_buffers(xn, act_qk, no_qk)
        for r in prange(S if act_qk else 0):
            quantize_q8_k_rows(xn, xqk[0], xqk[1], xqk[2], r, r + 1)
        for c in prange(n_chunks):
            lo, hi = _span(c, n_chunks, inter, panels, act_qk)
            _product_range(xn, xq8, act_q8, panels, per_row, gate_up_w, gu, lo, hi, xqk)
            _product_range(xn, xq8, act_q8, panels, per_row, gate_up_w, gu, inter + lo,
                           inter + hi, xqk)
            for t in range(S):
                for i in range(lo, hi):
                    a = gu[t, i]
                    act[t, i] = a / (np.float32(1.0) + exp_f32(-a)) * gu[t, inter + i]

        xq8 = _q8_operand(act, act_q8, no_q8)
        xqk = _qk_buffers(act, act_qk, no_qk)
        for r in prange(S if act_qk else 0):
            quantize_q8_k_rows(act, xqk[0], xqk[1], xqk[2], r, r + 1)
        for c in prange(n_chunks):
            lo, hi = _span(c, n_chunks, H, panels, act_qk)
            _product_range(act, xq8, act_q8, panels, per_row, down_w, x, lo, hi, xqk)


@njit(cache=True)
def _new_list(first):  # pragma: no cover - compiled
    out = List()
    out.append(first)
    return out


@njit(cache=True)
def _push(items, item):  # pragma: no cover - compiled
    items.append(item)


def typed_list(items: list):
    """A Numba typed List of ``items`` (all of one Numba type; at least one),
    built by cached compiled functions: the Python-side ``List()`` methods
    are compiled afresh in every process (0.6-0.8 s a start-up for the
    layer and cache types on the 2-core machine), these come from Numba's
    disk cache (0.18 s). Call no ``List`` method on the result from Python
    (``len`` included): each would compile."""
    out = _new_list(items[0])
    for item in items[1:]:
        _push(out, item)
    return out
