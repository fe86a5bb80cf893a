"""Numba kernels for llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) with Q8_K activations.

A K-quant weight ``W`` [N, K] is stored in super-blocks of ``QK_K = 256``
input channels per row (ggml's ``ggml-common.h``: ``block_q4_K``,
``block_q5_K``, ``block_q6_K``; formulas from ``dequantize_row_q4_K`` etc.
in ``ggml-quants.c``, re-derived here, no code copied):

- ``Q4_K`` (144 bytes): float16 ``d`` and ``dmin``, 12 bytes holding eight
  6-bit scales ``sc`` and eight 6-bit mins ``m`` (``get_scale_min_k4``),
  128 bytes of nibbles; value ``v`` of sub-block ``j = v // 32`` is
  ``d * sc[j] * q - dmin * m[j]`` with ``q`` in 0..15.
- ``Q5_K`` (176 bytes): the same with a fifth bit per code from 32 bytes
  ``qh``: ``q`` in 0..31.
- ``Q6_K`` (210 bytes): 128 bytes of low nibbles ``ql``, 64 of 2-bit high
  parts ``qh``, sixteen int8 scales (one per 16 values), float16 ``d``:
  ``d * sc[v // 16] * (q - 32)`` with ``q`` in 0..63.

The activations are quantized per row and super-block to Q8_K
(``quantize_row_q8_K_ref``): ``iscale = -127 / x_max`` where ``x_max`` is the
value of largest magnitude, codes ``min(127, rint(iscale * x))``, scale
``xd = 1 / iscale``, and ``bsums``: the sums of each 16 codes. A product is
then llama.cpp's ``ggml_vec_dot_q4_K_q8_K`` (and its Q5_K / Q6_K twins): per
super-block, the exact integer sums ``I_j`` of codes times activation codes
of each sub-block give ``isum = sum_j sc[j] * I_j`` and ``msum = sum_j m[j] *
bsum_j``, and the row gains ``d * xd * isum - dmin * xd * msum`` (Q6_K:
``isum = sum_j sc[j] * (I_j - 32 bsum_j)``, no ``msum``). Only the order
of the float sums over super-blocks can differ from llama.cpp's.

The kernels take the weight packed once (:func:`pack_kquant`) into panels of
``KLANES`` = 16 output channels, as ``panel_kernels`` does for Q4_0/Q4_1:
for each super-block, 4 consecutive bytes of each of the 16 channels side by
side, so that one four-byte dot product (``vpdpbusd`` with AVX512-VNNI,
``vpmaddubsw`` + ``vpmaddwd`` on two ymm halves with AVX2, a generic form
elsewhere; the forms of ``panel_kernels``) adds four code products to every
channel's sum. Q4_K keeps its nibbles (the bytes of a 64-value chunk hold
sub-block ``2c`` in their low nibbles and ``2c + 1`` in their high ones, as
ggml stores them: the packing is a byte permutation); Q5_K and Q6_K codes
are widened to one byte each. Per channel and super-block the panels hold:

=========  ===========  ===========  ============  ================  ==========
type       codes        scales       mins          d, -dmin (f32)    file bytes
=========  ===========  ===========  ============  ================  ==========
Q4_K       128          8            8             8                 144
Q5_K       256          8            8             8                 176
Q6_K       192          16 (int8)    --            8                 210
=========  ===========  ===========  ============  ================  ==========

so Q4_K's panels are 1.06x the file's bytes, Q5_K's 1.59x and Q6_K's 1.03x.
Q6_K's codes are split as ggml splits them, in a plane of low nibbles (laid
out as Q4_K's) and a plane of 2-bit high parts, four to a byte; the kernel
joins them per group of 4 codes (a shift, a mask and an ``or``). No integer sum overflows: ``|I_j| <= 32 * 31 * 127``,
``|sc * I| * 8 < 2**31``, and a pair of products fits ``vpmaddubsw``'s int16
(``2 * 63 * 127``).

Arrays must be C-contiguous with the dtypes given on each function
(``kvserve.cpu.kquant_ops`` checks them).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kvserve.cpu.panel_kernels import (DOT4, DOT_AVX2, DOT_FAST, DOT_GENERIC, _splat_value,
                                       emit_dot_forms, store_tile)

#: Values per super-block (ggml's QK_K).
QK_K = 256
#: Output channels of a panel (fixed, so that a packed file serves any CPU).
KLANES = 16
#: Activation rows per register tile.
ROWS = 4
#: Super-blocks ahead whose codes the tile prefetches (``llvm.prefetch``):
#: one row over 608 MiB of Q4_K panels read at 24.3-25.4 GB/s with 4, at
#: 22.7-23.5 without (two runs each, this session's Xeon, 2 threads; 32 rows
#: did not slow down).
PREFETCH_AHEAD = 4
#: The K-quant types, as the ``kind`` argument of the kernels.
Q4_K, Q5_K, Q6_K = 0, 1, 2
KIND_OF = {"Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}
#: Bytes of one super-block in the GGUF file.
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
#: Per kind: (code bytes, sub-blocks, bytes of mins) per channel and super-block.
_LAYOUT = {Q4_K: (128, 8, 8), Q5_K: (256, 8, 8), Q6_K: (192, 16, 0)}


def packed_shapes(kind: int, n: int, k: int) -> dict[str, tuple[int, int]]:
    """Shapes of the panel arrays of a [n, k] weight of ``kind``:
    ``codes`` / ``scales`` / ``mins`` uint8, ``dd`` float32 (a weight
    without mins gets a [n / 16, 1] placeholder). n a multiple of 16, k of 256."""
    code_bytes, nsub, min_bytes = _LAYOUT[kind]
    groups, nsb = n // KLANES, k // QK_K
    return {"codes": (groups, nsb * code_bytes * KLANES),
            "scales": (groups, nsb * nsub * KLANES),
            "mins": (groups, max(nsb * min_bytes * KLANES, 1)),
            "dd": (groups, nsb * 2 * KLANES)}


# --------------------------------------------------------------------------- #
# Decoding ggml's super-blocks
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True, inline="always")
def _scale_min_k4(j, q, base):
    """(scale, min) of sub-block j (0..7) from the 12 bytes at ``q[base:]``
    (ggml's ``get_scale_min_k4``)."""
    a, b = np.int32(q[base + j]), np.int32(q[base + j + 4]) if j < 8 else np.int32(0)
    if j < 4:
        return a & 63, b & 63
    before = np.int32(q[base + j - 4])
    return (b & 0xF) | ((before >> 6) << 4), (b >> 4) | ((a >> 6) << 4)


@njit(nogil=True, cache=True)
def decode_superblock(block, kind, codes, scales, mins):
    """The codes, scales and mins of one super-block ``block`` (uint8 bytes).

    Writes codes: uint8[256] (0..15, 0..31 or 0..63), scales: int32[16]
    (Q4_K / Q5_K: eight 6-bit values; Q6_K: sixteen signed ones), mins:
    int32[8] (Q6_K: untouched)."""
    if kind == Q6_K:
        for h in range(2):
            for quarter in range(4):
                for l in range(32):
                    byte = np.int32(block[64 * h + l + 32 * (quarter & 1)])
                    lo = (byte & 0xF) if quarter < 2 else (byte >> 4)
                    hi = (np.int32(block[128 + 32 * h + l]) >> (2 * quarter)) & 3
                    codes[128 * h + 32 * quarter + l] = np.uint8(lo | (hi << 4))
        for j in range(16):
            scales[j] = np.int32(np.int8(block[192 + j]))
        return
    qs = 16 if kind == Q4_K else 48
    for j in range(8):
        sc, mn = _scale_min_k4(j, block, 4)
        scales[j] = np.int32(sc)
        mins[j] = np.int32(mn)
    for c in range(4):
        for l in range(32):
            byte = np.int32(block[qs + 32 * c + l])
            lo, hi = byte & 0xF, byte >> 4
            if kind == Q5_K:
                high = np.int32(block[16 + l])
                lo += ((high >> (2 * c)) & 1) << 4
                hi += ((high >> (2 * c + 1)) & 1) << 4
            codes[64 * c + l] = np.uint8(lo)
            codes[64 * c + 32 + l] = np.uint8(hi)


@njit(nogil=True, cache=True)
def dequantize_rows(blocks, d, dmin, kind, out):
    """float32 values of rows of a K-quant weight (the embedding's lookups,
    and the reference of the tests).

    blocks: uint8[R, nsb, block bytes]; d, dmin: float32[R, nsb] (the
    blocks' float16 scales widened; dmin ignored for Q6_K); out: float32[R,
    nsb * 256]. Each value is computed as ``(d * sc) * q - (dmin * m) ``
    (Q6_K: ``(d * sc) * (q - 32)``), ggml's order."""
    codes = np.empty(QK_K, np.uint8)
    scales = np.zeros(16, np.int32)
    mins = np.zeros(8, np.int32)
    for r in range(blocks.shape[0]):
        for s in range(blocks.shape[1]):
            decode_superblock(blocks[r, s], kind, codes, scales, mins)
            for v in range(QK_K):
                if kind == Q6_K:
                    scale = d[r, s] * np.float32(scales[v // 16])
                    out[r, QK_K * s + v] = scale * np.float32(np.int32(codes[v]) - 32)
                else:
                    j = v // 32
                    scale = d[r, s] * np.float32(scales[j])
                    out[r, QK_K * s + v] = (scale * np.float32(codes[v])
                                            - dmin[r, s] * np.float32(mins[j]))


@njit(nogil=True, cache=True)
def pack_kquant(blocks, kind, codes_out, scales_out, mins_out):
    """Pack the super-blocks of N channels into panels of 16 (module docstring).

    blocks: uint8[N, nsb, block bytes], N a multiple of 16. Writes, for
    panel G, channel c of it and super-block s:

    - Q4_K codes: byte ``(32 s + 8 k + g) * 64 + 4 c + t`` = byte ``32 k +
      4 g + t`` of the block's nibbles (chunk k, group g, t < 4);
    - Q6_K codes, from byte ``3072 s``: byte ``(8 k + g) * 64 + 4 c + t``
      holds the low 4 bits of code ``64 k + 4 g + t`` (low nibble) and of
      code ``64 k + 32 + 4 g + t`` (high nibble); then byte ``2048 + ((2 k +
      h) * 2 + q) * 64 + 4 c + t`` holds in its bits ``2 i, 2 i + 1`` the top
      2 bits of code ``64 k + 32 h + 4 (4 q + i) + t``;
    - Q5_K codes: byte ``(64 s + g) * 64 + 4 c + t`` = code ``4 g + t``;
    - scales: byte ``(nsub s + j) * 16 + c`` (Q6_K's int8 as its bits);
    - mins (Q4_K, Q5_K): byte ``(8 s + j) * 16 + c``.
    """
    n, nsb = blocks.shape[0], blocks.shape[1]
    codes = np.empty(QK_K, np.uint8)
    scales = np.zeros(16, np.int32)
    mins = np.zeros(8, np.int32)
    nsub = 16 if kind == Q6_K else 8
    for ch in range(n):
        G, c = ch // KLANES, ch % KLANES
        for s in range(nsb):
            block = blocks[ch, s]
            decode_superblock(block, kind, codes, scales, mins)
            if kind == Q4_K:
                for k in range(4):
                    for g in range(8):
                        for t in range(4):
                            codes_out[G, (32 * s + 8 * k + g) * 64 + 4 * c + t] = \
                                block[16 + 32 * k + 4 * g + t]
            elif kind == Q6_K:
                base = 192 * 16 * s
                for k in range(4):
                    for g in range(8):
                        for t in range(4):
                            lo = np.int32(codes[64 * k + 4 * g + t])
                            hi = np.int32(codes[64 * k + 32 + 4 * g + t])
                            codes_out[G, base + (8 * k + g) * 64 + 4 * c + t] = np.uint8(
                                (lo & 15) | ((hi & 15) << 4))
                    for h in range(2):
                        for q in range(2):
                            for t in range(4):
                                bits = 0
                                for i in range(4):
                                    code = np.int32(codes[64 * k + 32 * h + 4 * (4 * q + i) + t])
                                    bits |= (code >> 4) << (2 * i)
                                codes_out[G, base + 2048 + ((2 * k + h) * 2 + q) * 64 + 4 * c
                                          + t] = np.uint8(bits)
            else:
                for g in range(64):
                    for t in range(4):
                        codes_out[G, (64 * s + g) * 64 + 4 * c + t] = codes[4 * g + t]
            for j in range(nsub):
                scales_out[G, (nsub * s + j) * 16 + c] = np.uint8(scales[j] & 0xFF)
            if kind != Q6_K:
                for j in range(8):
                    mins_out[G, (8 * s + j) * 16 + c] = np.uint8(mins[j])


# --------------------------------------------------------------------------- #
# Q8_K activations
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def quantize_q8_k_rows(x, xq, xd, bsums, r0, r1):
    """Rows [r0, r1) of :func:`quantize_q8_k` (arguments as there)."""
    K = x.shape[1]
    for r in range(r0, r1):
        for s in range(K // QK_K):
            o = QK_K * s
            amax = np.float32(0.0)
            for j in range(QK_K):  # a max: vectorized
                amax = max(amax, abs(x[r, o + j]))
            if amax == 0:
                xd[r, s] = np.float32(0.0)
                xq[r, o:o + QK_K] = 0
                bsums[r, 16 * s:16 * s + 16] = 0
                continue
            vmax = np.float32(0.0)
            for j in range(QK_K):  # the first value of that magnitude, with its sign
                if abs(x[r, o + j]) == amax:
                    vmax = x[r, o + j]
                    break
            iscale = np.float32(-127.0) / vmax
            for j in range(16):
                total = np.int32(0)
                for i in range(16):
                    q = min(np.rint(iscale * x[r, o + 16 * j + i]), np.float32(127.0))
                    xq[r, o + 16 * j + i] = np.int8(q)
                    total += np.int32(q)
                bsums[r, 16 * s + j] = total
            xd[r, s] = np.float32(1.0) / iscale


@njit(nogil=True, cache=True)
def quantize_q8_k(x, xq, xd, bsums):
    """llama.cpp's Q8_K of float32[M, K] ``x`` (K a multiple of 256).

    Writes xq: int8[M, K], xd: float32[M, K / 256], bsums: int32[M, K / 16].
    Per super-block: ``iscale = -127 / v`` where ``v`` is the value of largest
    magnitude (the first such), codes ``min(127, rint(iscale * x))`` (round
    half to even, as ggml's ``nearest_int``), ``xd = 1 / iscale``; an
    all-zero super-block gets xd 0 and zero codes."""
    quantize_q8_k_rows(x, xq, xd, bsums, 0, x.shape[0])


@njit(nogil=True, cache=True, parallel=True)
def quantize_q8_k_parallel(x, xq, xd, bsums, n_chunks):
    """:func:`quantize_q8_k` in ``n_chunks`` parallel ranges of rows."""
    M = x.shape[0]
    for c in prange(n_chunks):
        quantize_q8_k_rows(x, xq, xd, bsums, c * M // n_chunks, (c + 1) * M // n_chunks)


# --------------------------------------------------------------------------- #
# The tile: ROWS (or fewer) rows x 16 channels, the super-block loop in LLVM IR
# --------------------------------------------------------------------------- #

_i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


class _KTileEmitter:
    """Emits the LLVM IR of one K-quant tile (``_ktile_codegen``): the
    arrays' row pointers and constants once, then one super-block loop per
    kind and dot form, then the store of the accumulators."""

    def __init__(self, rows: int, context, builder, sig, args) -> None:
        L = KLANES
        self.rows, self.builder, self.args = rows, builder, args

        def array(i):
            return context.make_array(sig.args[i])(context, builder, args[i])

        codes, scales, mins, dd, xq, xd, bsums, out = (array(i) for i in range(8))
        m, n0 = args[8], args[9]
        self.i64 = i64 = m.type
        panel = builder.udiv(n0, i64(L))
        self.c_row, self.s_row, self.m_row, self.d_row = (
            self._row(a, panel) for a in (codes, scales, mins, dd))
        ms = [builder.add(m, i64(r)) for r in range(rows)]
        self.x_rows, self.xd_rows, self.bs_rows = (
            [self._row(a, r) for r in ms] for a in (xq, xd, bsums))
        self.out_rows = lambda: [self._row(out, r) for r in ms]
        self.n0 = n0
        self.nsb = builder.extract_value(xd.shape, 1)
        self.vbytes, self.vint, self.vfloat = _vec(_i8, 4 * L), _vec(_i32, L), _vec(_f32, L)
        self.v16b = _vec(_i8, L)
        vfloat = self.vfloat
        self.fmuladd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vfloat, [vfloat] * 3), f"llvm.fmuladd.v{L}f32")
        self.prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_i8.as_pointer(), _i32, _i32, _i32]),
            "llvm.prefetch.p0i8")
        self.accs = [cgutils.alloca_once_value(builder, ir.Constant(vfloat, [0.0] * L))
                     for _ in range(rows)]
        self.zero = ir.Constant(self.vint, [0] * L)
        self.low_mask = ir.Constant(self.vbytes, [15] * 4 * L)
        self.four = ir.Constant(self.vbytes, [4] * 4 * L)
        self.top_mask = ir.Constant(self.vbytes, [0x30] * 4 * L)

    def _row(self, a, r):  # pointer to row r of a C-contiguous 2-D array
        builder = self.builder
        return builder.gep(a.data, [builder.mul(r, builder.extract_value(a.shape, 1))])

    def x_splat(self, r, s, value):
        """Activation bytes value .. value + 3 of super-block s, row r, in every lane."""
        builder, i64 = self.builder, self.i64
        off = builder.add(builder.mul(s, i64(QK_K)), i64(value))
        ptr = builder.bitcast(builder.gep(self.x_rows[r], [off]), _i32.as_pointer())
        return _splat_value(builder, builder.load(ptr, align=1), KLANES)

    def lane_bytes(self, base_row, s, per_sb, j, signed):
        """<16 x i32> of the 16 bytes (one a lane) of group j of super-block s."""
        builder, i64 = self.builder, self.i64
        off = builder.add(builder.mul(s, i64(per_sb * KLANES)), i64(j * KLANES))
        ptr = builder.bitcast(builder.gep(base_row, [off]), self.v16b.as_pointer())
        raw = builder.load(ptr, align=1)
        return (builder.sext if signed else builder.zext)(raw, self.vint)

    def bsum(self, r, s, first, count):
        """Sum of bsums[r][16 s + first ...] (count of them) as i32."""
        builder, i64 = self.builder, self.i64
        total = None
        for t in range(count):
            idx = builder.add(builder.mul(s, i64(16)), i64(first + t))
            value = builder.load(builder.gep(self.bs_rows[r], [idx]))
            total = value if total is None else builder.add(total, value)
        return total

    def load_codes(self, kind, s, group):
        """The 4 x 16 code bytes of ``group`` in super-block s."""
        builder, i64 = self.builder, self.i64
        code_bytes = _LAYOUT[kind][0]
        off = builder.add(builder.mul(s, i64(code_bytes * KLANES)), i64(group * 4 * KLANES))
        ptr = builder.bitcast(builder.gep(self.c_row, [off]), self.vbytes.as_pointer())
        return builder.load(ptr, align=1)

    def prefetch_ahead(self, kind, s):
        """The codes of the super-block PREFETCH_AHEAD on, a cache line at a
        time (a hint: past the end of the array it is dropped)."""
        builder, i64 = self.builder, self.i64
        code_bytes = _LAYOUT[kind][0]
        ahead = builder.mul(builder.add(s, i64(PREFETCH_AHEAD)), i64(code_bytes * KLANES))
        for line in range(0, code_bytes * KLANES, 64):
            ptr = builder.gep(self.c_row, [builder.add(ahead, i64(line))])
            builder.call(self.prefetch, [ptr, _i32(0), _i32(3), _i32(1)])

    def scale_sub(self, kind, s, j, sums, isum, msum):
        """Scale sub-block j's integer sums into ``isum`` (Q6_K: its codes'
        offset of 32 taken out first) and, for kinds with mins, add its
        mins times the activations' block sums into ``msum``."""
        builder, rows = self.builder, self.rows
        nsub = _LAYOUT[kind][1]
        sc = self.lane_bytes(self.s_row, s, nsub, j, kind == Q6_K)
        for r in range(rows):
            if kind == Q6_K:
                off = builder.mul(self.bsum(r, s, j, 1), _i32(32))
                sums[r] = builder.sub(sums[r], _splat_value(builder, off, KLANES))
            isum[r] = builder.add(isum[r], builder.mul(sc, sums[r]))
        if kind != Q6_K:
            mn = self.lane_bytes(self.m_row, s, 8, j, False)
            for r in range(rows):
                b = _splat_value(builder, self.bsum(r, s, 2 * j, 2), KLANES)
                msum[r] = builder.add(msum[r], builder.mul(mn, b))

    def q6k_sums(self, s, dot4, isum, msum):
        """Q6_K: low nibbles with two high bits each, 16 sub-blocks."""
        builder, rows, zero, L = self.builder, self.rows, self.zero, KLANES
        for k in range(4):
            sums = [[zero] * rows for _ in range(4)]  # sub-blocks 4k .. 4k + 3
            high = [[self.load_codes(Q6_K, s, 32 + (2 * k + h) * 2 + q) for q in range(2)]
                    for h in range(2)]
            for g in range(8):
                both = self.load_codes(Q6_K, s, 8 * k + g)
                q, i = g // 4, g % 4
                for h, nib in ((0, builder.and_(both, self.low_mask)),
                               (1, builder.lshr(both, self.four))):
                    shift = 4 - 2 * i
                    bits = high[h][q]
                    if shift > 0:
                        bits = builder.shl(bits, ir.Constant(self.vbytes, [shift] * 4 * L))
                    elif shift < 0:
                        bits = builder.lshr(bits, ir.Constant(self.vbytes, [-shift] * 4 * L))
                    code = builder.bitcast(builder.or_(
                        nib, builder.and_(bits, self.top_mask)), self.vint)
                    sub = 2 * h + q
                    for r in range(rows):
                        sums[sub][r] = dot4(builder, sums[sub][r], code,
                                            self.x_splat(r, s, 64 * k + 32 * h + 4 * g), L)
            for sub in range(4):
                self.scale_sub(Q6_K, s, 4 * k + sub, sums[sub], isum, msum)

    def q4k_sums(self, s, dot4, isum, msum):
        """Q4_K: two nibbles a byte, the low ones one sub-block, the high ones the next."""
        builder, rows, zero = self.builder, self.rows, self.zero
        for k in range(4):
            lo_sums, hi_sums = [zero] * rows, [zero] * rows
            for g in range(8):
                both = self.load_codes(Q4_K, s, 8 * k + g)
                lo = builder.bitcast(builder.and_(both, self.low_mask), self.vint)
                hi = builder.bitcast(builder.lshr(both, self.four), self.vint)
                for r in range(rows):
                    lo_sums[r] = dot4(builder, lo_sums[r], lo,
                                      self.x_splat(r, s, 64 * k + 4 * g), KLANES)
                    hi_sums[r] = dot4(builder, hi_sums[r], hi,
                                      self.x_splat(r, s, 64 * k + 32 + 4 * g), KLANES)
            self.scale_sub(Q4_K, s, 2 * k, lo_sums, isum, msum)
            self.scale_sub(Q4_K, s, 2 * k + 1, hi_sums, isum, msum)

    def byte_code_sums(self, kind, s, dot4, isum, msum):
        """Q5_K: a whole byte a code, sub-block after sub-block."""
        builder, rows = self.builder, self.rows
        nsub = _LAYOUT[kind][1]
        per_sub = QK_K // nsub // 4  # groups of 4 values per sub-block
        for j in range(nsub):
            sums = [self.zero] * rows
            for g in range(per_sub):
                group = j * per_sub + g
                w = builder.bitcast(self.load_codes(kind, s, group), self.vint)
                for r in range(rows):
                    sums[r] = dot4(builder, sums[r], w, self.x_splat(r, s, 4 * group), KLANES)
            self.scale_sub(kind, s, j, sums, isum, msum)

    def accumulate(self, kind, s, isum, msum):
        """accs[r] += d * xd[r, s] * isum[r] (- dmin * xd[r, s] * msum[r])."""
        builder, i64, vfloat = self.builder, self.i64, self.vfloat
        dptr = builder.gep(self.d_row, [builder.mul(s, i64(2 * KLANES))])
        dvec = builder.load(builder.bitcast(dptr, vfloat.as_pointer()), align=4)
        mvec = builder.load(builder.bitcast(builder.gep(dptr, [i64(KLANES)]),
                                            vfloat.as_pointer()), align=4)
        for r in range(self.rows):
            xds = _splat_value(builder, builder.load(builder.gep(self.xd_rows[r], [s])), KLANES)
            acc = builder.call(self.fmuladd, [builder.sitofp(isum[r], vfloat),
                                              builder.fmul(dvec, xds), builder.load(self.accs[r])])
            if kind != Q6_K:
                acc = builder.call(self.fmuladd, [builder.sitofp(msum[r], vfloat),
                                                  builder.fmul(mvec, xds), acc])
            builder.store(acc, self.accs[r])

    def superblock_loop(self, kind, dot4):
        """The loop over the row's super-blocks for one kind and dot form."""
        with cgutils.for_range(self.builder, self.nsb) as loop:
            s = loop.index
            isum = [self.zero] * self.rows
            msum = [self.zero] * self.rows
            self.prefetch_ahead(kind, s)
            if kind == Q6_K:
                self.q6k_sums(s, dot4, isum, msum)
            elif kind == Q4_K:
                self.q4k_sums(s, dot4, isum, msum)
            else:
                self.byte_code_sums(kind, s, dot4, isum, msum)
            self.accumulate(kind, s, isum, msum)

    def all_kinds(self, form):
        """One loop per kind, chosen by the ``kind`` argument at run time."""
        builder, kind_arg = self.builder, self.args[10]
        with builder.if_else(builder.icmp_signed("==", kind_arg, kind_arg.type(Q4_K))) \
                as (q4k, other):
            with q4k:
                self.superblock_loop(Q4_K, DOT4[form])
            with other:
                with builder.if_else(builder.icmp_signed("==", kind_arg,
                                                         kind_arg.type(Q5_K))) as (q5k, q6k):
                    with q5k:
                        self.superblock_loop(Q5_K, DOT4[form])
                    with q6k:
                        self.superblock_loop(Q6_K, DOT4[form])

    def emit(self):
        """The whole tile: the loops of every dot form, then the store."""
        emit_dot_forms(self.builder, self.args[11], self.all_kinds)
        store_tile(self.builder, self.out_rows(), self.n0, self.accs)


def _ktile_codegen(rows: int):
    """Codegen of ``out[m + r, n0 : n0 + 16] = x[m + r] @ W[n0 : n0 + 16].T``.

    Arguments (codes, scales, mins, dd, xq, xd, bsums, out, m, n0, kind,
    dot), as :func:`kquant_range` takes them; ``rows`` is fixed here, the
    kind and the dot form are switched on at run time (one loop each).
    """

    def codegen(context, builder, sig, args):
        _KTileEmitter(rows, context, builder, sig, args).emit()
        return context.get_dummy_value()

    return codegen


def _ktile_intrinsic(rows: int):
    def typer(typingctx, codes, scales, mins, dd, xq, xd, bsums, out, m, n0, kind, dot):
        return (types.none(codes, scales, mins, dd, xq, xd, bsums, out, m, n0, kind, dot),
                _ktile_codegen(rows))
    typer.__name__ = f"_ktile_{rows}"
    return intrinsic(typer)


_t1, _t2, _t3, _t4 = (_ktile_intrinsic(r) for r in range(1, ROWS + 1))


@njit(nogil=True, cache=True, inline="always")
def _tile(kind, rows, dot, codes, scales, mins, dd, xq, xd, bsums, out, m, n0):
    """The tile of ``rows`` (1 to 4) rows from row m, channels n0 .. n0 + 15."""
    if rows == 4:
        _t4(codes, scales, mins, dd, xq, xd, bsums, out, m, n0, kind, dot)
    elif rows == 3:
        _t3(codes, scales, mins, dd, xq, xd, bsums, out, m, n0, kind, dot)
    elif rows == 2:
        _t2(codes, scales, mins, dd, xq, xd, bsums, out, m, n0, kind, dot)
    else:
        _t1(codes, scales, mins, dd, xq, xd, bsums, out, m, n0, kind, dot)


@njit(nogil=True, cache=True)
def kquant_range(xq, xd, bsums, codes, scales, mins, dd, out, lo, hi, kind, dot=DOT_FAST):
    """Channels [lo, hi) (multiples of 16) of ``out = x @ W.T`` for a K-quant
    weight packed by :func:`pack_kquant` and Q8_K activations
    (:func:`quantize_q8_k`): each panel's rows in tiles of 4 (a last tile of
    1 to 3). ``kind``: ``Q4_K``, ``Q5_K`` or ``Q6_K``; ``dot``: ``DOT_FAST``,
    ``DOT_GENERIC`` or ``DOT_AVX2`` (``panel_kernels``).

    xq: int8[M, K]; xd: float32[M, K / 256]; bsums: int32[M, K / 16];
    codes, scales, mins: uint8 and dd float32, as :func:`packed_shapes`;
    out: float32[M, N].
    """
    M = xq.shape[0]
    tiled = M - M % ROWS
    for n0 in range(lo, hi, KLANES):
        for m in range(0, tiled, ROWS):
            _tile(kind, ROWS, dot, codes, scales, mins, dd, xq, xd, bsums, out, m, n0)
        if M > tiled:
            _tile(kind, M - tiled, dot, codes, scales, mins, dd, xq, xd, bsums, out, tiled, n0)


@njit(nogil=True, cache=True, parallel=True)
def kquant_parallel(xq, xd, bsums, codes, scales, mins, dd, out, kind, n_chunks):
    """:func:`kquant_range` over all N channels in ``n_chunks`` parallel
    ranges of whole panels (arguments as there)."""
    groups = out.shape[1] // KLANES
    for c in prange(n_chunks):
        lo = KLANES * (c * groups // n_chunks)
        hi = KLANES * ((c + 1) * groups // n_chunks)
        kquant_range(xq, xd, bsums, codes, scales, mins, dd, out, lo, hi, kind, DOT_FAST)
