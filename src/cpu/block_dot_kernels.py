"""Numba kernels for ggml block weights with Q8 activations, ``y = x @ W.T``.

The scheme is llama.cpp's CPU one (``ggml-quants.c``:
``quantize_row_q8_0`` / ``quantize_row_q8_1`` for the activations,
``ggml_vec_dot_q4_0_q8_0``, ``ggml_vec_dot_q4_1_q8_1`` and
``ggml_vec_dot_q8_0_q8_0`` for the products; re-derived here, no code
copied). Each block of 32 activations of a row becomes int8 codes
``xq = rint(x * (1 / xd))`` with ``xd = max|x| / 127`` (round half to even, as
llama.cpp's AVX2 ``_mm256_round_ps(.., _MM_ROUND_NEAREST)``; its scalar
reference ``roundf`` rounds half away; the two differ only on exact ties)
and ``xsum = xd * sum(xq)`` (``block_q8_1``'s ``s``). Unlike llama.cpp, ``xd``
and ``xsum`` stay float32 (it stores them as float16). Then per weight
block ``b`` of channel ``n`` and row ``m``, with the exact int32 sum
``I = sum_j c_j * xq_j`` over the block's 32 codes ``c``:

- ``Q4_0``: ``c = q - 8``, ``y += d[n, b] * xd[m, b] * I``;
- ``Q4_1``: ``c = q``, ``y += d[n, b] * xd[m, b] * I + m[n, b] * xsum[m, b]``
  (``kvserve.model.ggml_blocks`` stores a Q4_0 block as ``m = -8 d``, so this
  kernel serves both; the Q4_0 one keeps the offset in the integers);
- ``Q8_0``: ``c = qs``, ``y += d[n, b] * xd[m, b] * I``.

No int32 sum can overflow or saturate: ``|I| <= 32 * 128 * 127``, and the
int16 pair sums of ``vpmaddubsw`` stay within ``2 * 128 * 127 < 2**15``
because ``xq`` is clipped to [-127, 127].

Two implementations of the per-row block dot product, chosen at import:

* AVX2 (``HAS_AVX2``): a Numba ``@intrinsic`` that writes the block loop in
  LLVM IR with the x86 intrinsics llama.cpp's AVX2 path uses. Per block:
  one 16-byte load of nibbles, ``vpand`` / ``vpsrlw`` + ``vpand`` and a
  ``vinserti128`` to 32 unsigned codes (Q4), one 32-byte load of ``xq``,
  ``vpsignb`` x 2 for the signed codes (Q4_0, Q8_0: ``|c| * sign(c) xq``),
  one ``vpmaddubsw`` (u8 x s8 -> 16 int16 pair sums), one ``vpmaddwd``
  with ones (-> 8 int32), ``vcvtdq2ps`` and one ``vfmadd`` on ymm with the
  broadcast ``d * xd``; one horizontal sum per row and channel. Rows go in
  tiles of ``ROW_TILE`` = 4 (each block's codes unpacked once for four rows,
  four independent FMA chains), a remainder of 2 or 3 rows in a 2-row tile,
  a last odd row alone (two FMA chains, even and odd blocks).
* Otherwise, plain loops, ``s = int32(s + int32(int32(c) * int32(xq)))``
  over the block's 16 bytes (Numba types int32 * int32 as int64; the outer
  casts keep the sums on 32-bit lanes). The assembly of that form on this
  machine has ``vpmovzxbw`` / ``vpmovsxbw`` + ``vpmaddwd`` on xmm and
  no ``vpmaddubsw``; LLVM's loop vectorizer takes 32 iterations per vector
  step (VF 8 x interleave 4), so a 16-byte block runs its 4-byte epilogue
  loop, and it measured slower than the float-dequantizing kernel of
  ``kvserve.cpu.block_kernels``. LLVM does not form ``vpmaddubsw`` from the
  equivalent generic IR either: the saturating clamp of its pattern is
  folded away, since the sums provably fit, and ``vpmullw`` remains.

What the assembly shows (``kernel.inspect_asm(kernel.signatures[0])`` of
the ``*_gemv_range`` kernels; this machine is an AMD EPYC that LLVM calls
"znver2" (family 23 model 49, Zen 2: AVX2 + FMA; ``/proc/cpuinfo`` lists no
avx512 and no avx_vnni / avx512_vnni, so ``vpdpbusd`` cannot be used),
LLVM via llvmlite 0.50 / Numba 0.68). The 4-row tile's loop (two blocks
per iteration), per block: one ``vmovdqu`` of 16 nibble bytes, ``vpsrlw`` +
``vinserti128`` + ``vpand`` (Q4; Q8_0 loads 32 codes), two ``vpsignb`` for
Q4_0 / Q8_0, then per row ``vpmaddubsw`` (with ``xq`` as its memory
operand), ``vpmaddwd``, ``vcvtdq2ps``, ``vmulss`` + ``vbroadcastss`` for
``d * xd`` and one ``vfmadd213ps`` on ymm, plus a scalar ``vfmadd231ss``
for Q4_1's ``m * xsum``: 7 instructions per row and block of 32 weights,
no spills of vector registers, no ``vpmulld`` and no 64-bit lanes. The
one-row loop is the same with the unpacking per row (14 per block).
Measured (``tools/bench_block_dot.py``, one core, the default model's
Q4_1 projections, quantization of x included): 2.8-4.0x faster than
``block_kernels`` at M = 1, 2x at M = 4, 1.1-1.2x at M = 16 and 0.9-1.05x
at M = 32, where the float kernel's 1 x 4 tile reuses each dequantized
panel across all rows while this one converts every row's int32 sums to
float per block; the Q8_0 LM head (49152 x 576, more memory-bound) 1.6x
at M = 1. See ``docs/benchmarks/2026-12-02-block-dot.json``.

Arrays must be C-contiguous with the dtypes documented on each function
(``kvserve.cpu.block_dot_ops`` checks them), so each kernel compiles once.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.core.extending import intrinsic

# Importing block_kernels also selects Numba's threading layer (via
# kvserve.cpu.kernels); _chunk splits channels into whole 4-channel panels.
from kvserve.cpu.block_kernels import _chunk

#: Input channels per block (ggml's QK8_0 = QK8_1 = QK4_0 = QK4_1).
QK = 32
#: Largest magnitude of an activation code (-128 is never produced).
Q8_MAX = 127


def _target_has_avx2() -> bool:
    """Whether Numba compiles for a CPU with AVX2 (and so x86 intrinsics lower)."""
    if numba_config.CPU_NAME or numba_config.CPU_FEATURES:
        return "+avx2" in (numba_config.CPU_FEATURES or "")
    try:
        return bool(llvm_binding.get_host_cpu_features().get("avx2", False))
    except RuntimeError:  # features unknown on this host
        return False


#: True when the block dot products use the AVX2 intrinsics (else plain loops).
HAS_AVX2 = _target_has_avx2()

_F0 = np.float32(0.0)
_I32 = np.int32
_LOW = np.int32(15)
_SHIFT = np.int32(4)
_EIGHT = np.int32(8)
_CODE_MAX = np.float32(Q8_MAX)


# --------------------------------------------------------------------------- #
# Activation quantization
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def quantize_q8_blocks(x, xq, xd, xsum):
    """Per-block symmetric int8 activations (llama.cpp's Q8_0 / Q8_1 blocks).

    x: float32[M, K], K a multiple of 32. Writes xq: int8[M, K],
    xd: float32[M, K / 32] = max|x| / 127 of each block, and
    xsum: float32[M, K / 32] = xd * sum of the block's codes. Codes are
    ``rint(x * (1 / xd))`` (round half to even), clipped to [-127, 127]; an
    all-zero block gets xd = 0 and zero codes. Non-finite x gives
    meaningless codes.
    """
    M, K = x.shape
    for m in range(M):
        for b in range(K // QK):
            o = QK * b
            amax = _F0
            for j in range(QK):
                amax = max(amax, abs(x[m, o + j]))
            scale = amax / _CODE_MAX
            inv = np.float32(1.0) / scale if scale > 0 else _F0
            total = _I32(0)
            for j in range(QK):
                q = min(max(np.rint(x[m, o + j] * inv), -_CODE_MAX), _CODE_MAX)
                xq[m, o + j] = np.int8(q)
                total += _I32(q)
            xd[m, b] = scale
            xsum[m, b] = np.float32(total) * scale


# --------------------------------------------------------------------------- #
# AVX2 row dot products: the block loop in LLVM IR
# --------------------------------------------------------------------------- #

_i8, _i16, _i32, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, v):
    return ir.Constant(_vec(t, n), [v] * n)


def _fn(module, name, ret, args):
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


def _load_bytes(builder, base, offset, n):
    """<n x i8> at ``base + offset`` (unaligned)."""
    ptr = builder.bitcast(builder.gep(base, [offset]), _vec(_i8, n).as_pointer())
    return builder.load(ptr, align=1)


def _row_sums(builder, accs, tails, chains):
    """Each row's float32 result: its accumulator vectors (``chains`` of
    them, 1 or 2) added, summed across the 8 lanes pairwise, plus its
    scalar tail (q4_1's mins term)."""
    sums = []
    for acc, tail in zip(accs, tails):
        v = builder.load(acc[0])
        if chains == 2:
            v = builder.fadd(v, builder.load(acc[1]))
        for width in (4, 2, 1):  # pairwise horizontal sum
            lo = builder.shuffle_vector(v, v, ir.Constant(_vec(_i32, width),
                                                          list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(_vec(_i32, width),
                                                          list(range(width, 2 * width))))
            v = builder.fadd(lo, hi)
        sums.append(builder.fadd(builder.extract_element(v, _i32(0)), builder.load(tail)))
    return sums


def _dot_codegen(kind, rows):
    """Codegen of the dot products of weight row ``n`` with activation rows
    ``m .. m + rows - 1``: ``sum_b d[n, b] * xd[r, b] * I_b (+ sum_b
    mn[n, b] * xsum[r, b] for q4_1)``, the loop over blocks in IR.

    Arguments (qs, n, xq, m, d, xd[, mn, xsum]), 2-D C-contiguous arrays
    (row r of a [R, C] array starts at ``data + r * C``); returns a float32
    for one row, a UniTuple(float32, rows) otherwise.
    """

    def codegen(context, builder, sig, args):
        def array(i):
            return context.make_array(sig.args[i])(context, builder, args[i])

        def row(a, r):  # pointer to row r of a C-contiguous 2-D array
            return builder.gep(a.data, [builder.mul(r, builder.extract_value(a.shape, 1))])

        qs, xq, d, xd = array(0), array(2), array(4), array(5)
        n, m = args[1], args[3]
        w_row, d_row = row(qs, n), row(d, n)
        ms = [builder.add(m, m.type(r)) for r in range(rows)]
        x_rows, xd_rows = [row(xq, r) for r in ms], [row(xd, r) for r in ms]
        if kind == "q4_1":
            mn, xsum = array(6), array(7)
            mn_row, xsum_rows = row(mn, n), [row(xsum, r) for r in ms]
        module = builder.module
        maddubs = _fn(module, "llvm.x86.avx2.pmadd.ub.sw", _vec(_i16, 16),
                      [_vec(_i8, 32), _vec(_i8, 32)])
        maddwd = _fn(module, "llvm.x86.avx2.pmadd.wd", _vec(_i32, 8),
                     [_vec(_i16, 16), _vec(_i16, 16)])
        psign = _fn(module, "llvm.x86.avx2.psign.b", _vec(_i8, 32),
                    [_vec(_i8, 32), _vec(_i8, 32)])
        fmuladd8 = _fn(module, "llvm.fmuladd.v8f32", _vec(_f32, 8), [_vec(_f32, 8)] * 3)
        fmuladd = _fn(module, "llvm.fmuladd.f32", _f32, [_f32] * 3)
        nb = builder.extract_value(d.shape, 1)
        # A lone row alternates two accumulators (even and odd blocks) so as
        # not to wait out the FMA latency (5 cycles on Zen 2) at every block;
        # a tile's rows are independent chains already.
        chains = 2 if rows == 1 else 1
        accs = [[cgutils.alloca_once_value(builder, _splat(_f32, 8, 0.0))] * 2 if chains == 1
                 else [cgutils.alloca_once_value(builder, _splat(_f32, 8, 0.0))
                       for _ in range(2)] for _ in range(rows)]
        tails = [cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0)) for _ in range(rows)]
        concat = ir.Constant(_vec(_i32, 32), list(range(32)))
        zeros8 = ir.Constant(_vec(_i32, 8), [0] * 8)
        undef8 = ir.Constant(_vec(_f32, 8), None)

        def block(b, parity):
            """acc[r] += d[n, b] * xd[r, b] * (8 int32 partial sums of block b), each r."""
            if kind == "q8_0":
                codes = _load_bytes(builder, w_row, builder.mul(b, b.type(32)), 32)
            else:
                q = _load_bytes(builder, w_row, builder.mul(b, b.type(16)), 16)
                low = builder.and_(q, _splat(_i8, 16, 15))
                high = builder.lshr(q, _splat(_i8, 16, 4))
                codes = builder.shuffle_vector(low, high, concat)
                if kind == "q4_0":
                    codes = builder.sub(codes, _splat(_i8, 32, 8))
            signs = codes
            if kind != "q4_1":  # signed codes: |c| (as u8) times sign(c) * xq
                codes = builder.call(psign, [codes, codes])
            db = builder.load(builder.gep(d_row, [b]))
            for r in range(rows):
                xv = _load_bytes(builder, x_rows[r], builder.mul(b, b.type(32)), 32)
                if kind != "q4_1":
                    xv = builder.call(psign, [xv, signs])
                pairs = builder.call(maddubs, [codes, xv])
                quads = builder.call(maddwd, [pairs, _splat(_i16, 16, 1)])
                scale = builder.fmul(db, builder.load(builder.gep(xd_rows[r], [b])))
                scale8 = builder.shuffle_vector(
                    builder.insert_element(undef8, scale, _i32(0)), undef8, zeros8)
                acc = accs[r][parity]
                builder.store(builder.call(fmuladd8, [builder.sitofp(quads, _vec(_f32, 8)),
                                                      scale8, builder.load(acc)]), acc)
                if kind == "q4_1":
                    builder.store(builder.call(fmuladd, [
                        builder.load(builder.gep(mn_row, [b])),
                        builder.load(builder.gep(xsum_rows[r], [b])),
                        builder.load(tails[r])]), tails[r])

        one = nb.type(1)
        with cgutils.for_range(builder, builder.lshr(nb, one)) as loop:
            b = builder.shl(loop.index, one)
            block(b, 0)
            block(builder.add(b, one), 1)
        odd = builder.icmp_unsigned("!=", builder.and_(nb, one), nb.type(0))
        with builder.if_then(odd):
            block(builder.sub(nb, one), 0)
        sums = _row_sums(builder, accs, tails, chains)
        if rows == 1:
            return sums[0]
        return context.make_tuple(builder, sig.return_type, sums)

    return codegen


#: Activation rows per register tile of the AVX2 kernels (one weight block
#: unpacked once for all of them); a remainder of 2 or 3 rows takes a 2-row tile.
ROW_TILE = 4
_F32X4 = types.UniTuple(types.float32, ROW_TILE)
_F32X2 = types.UniTuple(types.float32, 2)


@intrinsic
def _avx2_q4_0(typingctx, qs, n, xq, m, d, xd):
    """float32 sum_b d[n, b] xd[m, b] sum_j (q_j - 8) xq[m, j]: weight row n
    (qs uint8[N, K / 2], d float32[N, K / 32]) with activation row m (xq
    int8[M, K], xd float32[M, K / 32])."""
    return types.float32(qs, n, xq, m, d, xd), _dot_codegen("q4_0", 1)


@intrinsic
def _avx2_q4_0_x4(typingctx, qs, n, xq, m, d, xd):
    """:func:`_avx2_q4_0` for rows m .. m + 3, a tuple of 4."""
    return _F32X4(qs, n, xq, m, d, xd), _dot_codegen("q4_0", ROW_TILE)


@intrinsic
def _avx2_q4_0_x2(typingctx, qs, n, xq, m, d, xd):
    """:func:`_avx2_q4_0` for rows m, m + 1, a tuple of 2."""
    return _F32X2(qs, n, xq, m, d, xd), _dot_codegen("q4_0", 2)


@intrinsic
def _avx2_q4_1(typingctx, qs, n, xq, m, d, xd, mn, xsum):
    """float32 sum_b (d[n, b] xd[m, b] sum_j q_j xq[m, j] + mn[n, b] xsum[m, b])."""
    return types.float32(qs, n, xq, m, d, xd, mn, xsum), _dot_codegen("q4_1", 1)


@intrinsic
def _avx2_q4_1_x4(typingctx, qs, n, xq, m, d, xd, mn, xsum):
    """:func:`_avx2_q4_1` for rows m .. m + 3, a tuple of 4."""
    return _F32X4(qs, n, xq, m, d, xd, mn, xsum), _dot_codegen("q4_1", ROW_TILE)


@intrinsic
def _avx2_q4_1_x2(typingctx, qs, n, xq, m, d, xd, mn, xsum):
    """:func:`_avx2_q4_1` for rows m, m + 1, a tuple of 2."""
    return _F32X2(qs, n, xq, m, d, xd, mn, xsum), _dot_codegen("q4_1", 2)


@intrinsic
def _avx2_q8_0(typingctx, qs, n, xq, m, d, xd):
    """float32 sum_b d[n, b] xd[m, b] sum_j w_j xq[m, j], qs int8[N, K]."""
    return types.float32(qs, n, xq, m, d, xd), _dot_codegen("q8_0", 1)


@intrinsic
def _avx2_q8_0_x4(typingctx, qs, n, xq, m, d, xd):
    """:func:`_avx2_q8_0` for rows m .. m + 3, a tuple of 4."""
    return _F32X4(qs, n, xq, m, d, xd), _dot_codegen("q8_0", ROW_TILE)


@intrinsic
def _avx2_q8_0_x2(typingctx, qs, n, xq, m, d, xd):
    """:func:`_avx2_q8_0` for rows m, m + 1, a tuple of 2."""
    return _F32X2(qs, n, xq, m, d, xd), _dot_codegen("q8_0", 2)


# --------------------------------------------------------------------------- #
# Portable dot products: plain loops with int32 sums (same arguments)
# --------------------------------------------------------------------------- #

_LOOP_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(nogil=True, cache=True, inline="always")
def _q4_block_sum(qs, n, i, xq, m, o, half, offset):
    """sum_j (lo(q_j) - offset) xq[m, o + j] + (hi(q_j) - offset) xq[m, o + half + j]."""
    s = _I32(0)
    for j in range(half):
        q = _I32(qs[n, i + j])
        s = _I32(s + _I32(_I32(_I32(q & _LOW) - offset) * _I32(xq[m, o + j])))
        s = _I32(s + _I32(_I32(_I32(q >> _SHIFT) - offset) * _I32(xq[m, o + half + j])))
    return s


@njit(nogil=True, cache=True, fastmath=_LOOP_FASTMATH)
def loop_q4_0(qs, n, xq, m, d, xd):
    """As ``_avx2_q4_0``, in plain loops (``half`` = 16 at run time)."""
    half = qs.shape[1] // d.shape[1]
    acc = _F0
    for b in range(d.shape[1]):
        acc += d[n, b] * xd[m, b] * np.float32(
            _q4_block_sum(qs, n, half * b, xq, m, 2 * half * b, half, _EIGHT))
    return acc


@njit(nogil=True, cache=True, fastmath=_LOOP_FASTMATH)
def loop_q4_1(qs, n, xq, m, d, xd, mn, xsum):
    """As ``_avx2_q4_1``, in plain loops."""
    half = qs.shape[1] // d.shape[1]
    acc = _F0
    for b in range(d.shape[1]):
        acc += d[n, b] * xd[m, b] * np.float32(
            _q4_block_sum(qs, n, half * b, xq, m, 2 * half * b, half, _I32(0))) \
            + mn[n, b] * xsum[m, b]
    return acc


@njit(nogil=True, cache=True, fastmath=_LOOP_FASTMATH)
def loop_q8_0(qs, n, xq, m, d, xd):
    """As ``_avx2_q8_0``, in plain loops."""
    qk = qs.shape[1] // d.shape[1]
    acc = _F0
    for b in range(d.shape[1]):
        o = qk * b
        s = _I32(0)
        for j in range(qk):
            s = _I32(s + _I32(_I32(qs[n, o + j]) * _I32(xq[m, o + j])))
        acc += d[n, b] * xd[m, b] * np.float32(s)
    return acc


@njit(nogil=True, cache=True)
def loop_q4_0_x4(qs, n, xq, m, d, xd):
    """:func:`loop_q4_0` for rows m .. m + 3."""
    return (loop_q4_0(qs, n, xq, m, d, xd), loop_q4_0(qs, n, xq, m + 1, d, xd),
            loop_q4_0(qs, n, xq, m + 2, d, xd), loop_q4_0(qs, n, xq, m + 3, d, xd))


@njit(nogil=True, cache=True)
def loop_q4_0_x2(qs, n, xq, m, d, xd):
    """:func:`loop_q4_0` for rows m, m + 1."""
    return loop_q4_0(qs, n, xq, m, d, xd), loop_q4_0(qs, n, xq, m + 1, d, xd)


@njit(nogil=True, cache=True)
def loop_q4_1_x2(qs, n, xq, m, d, xd, mn, xsum):
    """:func:`loop_q4_1` for rows m, m + 1."""
    return (loop_q4_1(qs, n, xq, m, d, xd, mn, xsum),
            loop_q4_1(qs, n, xq, m + 1, d, xd, mn, xsum))


@njit(nogil=True, cache=True)
def loop_q8_0_x2(qs, n, xq, m, d, xd):
    """:func:`loop_q8_0` for rows m, m + 1."""
    return loop_q8_0(qs, n, xq, m, d, xd), loop_q8_0(qs, n, xq, m + 1, d, xd)


@njit(nogil=True, cache=True)
def loop_q4_1_x4(qs, n, xq, m, d, xd, mn, xsum):
    """:func:`loop_q4_1` for rows m .. m + 3."""
    return (loop_q4_1(qs, n, xq, m, d, xd, mn, xsum),
            loop_q4_1(qs, n, xq, m + 1, d, xd, mn, xsum),
            loop_q4_1(qs, n, xq, m + 2, d, xd, mn, xsum),
            loop_q4_1(qs, n, xq, m + 3, d, xd, mn, xsum))


@njit(nogil=True, cache=True)
def loop_q8_0_x4(qs, n, xq, m, d, xd):
    """:func:`loop_q8_0` for rows m .. m + 3."""
    return (loop_q8_0(qs, n, xq, m, d, xd), loop_q8_0(qs, n, xq, m + 1, d, xd),
            loop_q8_0(qs, n, xq, m + 2, d, xd), loop_q8_0(qs, n, xq, m + 3, d, xd))


if HAS_AVX2:
    _q4_0, _q4_0_x2, _q4_0_x4 = _avx2_q4_0, _avx2_q4_0_x2, _avx2_q4_0_x4
    _q4_1, _q4_1_x2, _q4_1_x4 = _avx2_q4_1, _avx2_q4_1_x2, _avx2_q4_1_x4
    _q8_0, _q8_0_x2, _q8_0_x4 = _avx2_q8_0, _avx2_q8_0_x2, _avx2_q8_0_x4
else:
    _q4_0, _q4_0_x2, _q4_0_x4 = loop_q4_0, loop_q4_0_x2, loop_q4_0_x4
    _q4_1, _q4_1_x2, _q4_1_x4 = loop_q4_1, loop_q4_1_x2, loop_q4_1_x4
    _q8_0, _q8_0_x2, _q8_0_x4 = loop_q8_0, loop_q8_0_x2, loop_q8_0_x4


# --------------------------------------------------------------------------- #
# Decode products: channels [lo, hi) of out, every row, in tiles of ROW_TILE
# rows, then a 2-row tile and a single row as needed
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def q4_0_q8_gemv_range(xq, xd, qs, d, out, lo, hi):
    """Q4_0 weight (``w = d * (q - 8)``) times Q8 activations, channels [lo, hi).

    xq: int8[M, K]; xd: float32[M, K / 32]; qs: uint8[N, K / 2] (nibble
    layout of ``kvserve.model.ggml_blocks``); d: float32[N, K / 32];
    out: float32[M, N].
    """
    M = xq.shape[0]
    tiled = M - M % ROW_TILE
    pair = M - tiled >= 2
    for n in range(lo, hi):
        for m in range(0, tiled, ROW_TILE):
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = \
                _q4_0_x4(qs, n, xq, m, d, xd)
        if pair:
            m = tiled
            out[m, n], out[m + 1, n] = _q4_0_x2(qs, n, xq, m, d, xd)
        if M % 2:
            m = M - 1
            out[m, n] = _q4_0(qs, n, xq, m, d, xd)


@njit(nogil=True, cache=True)
def q4_1_q8_gemv_range(xq, xd, xsum, qs, d, mn, out, lo, hi):
    """Q4_1 weight (``w = d * q + m``, and Q4_0 as ``m = -8 d``) times Q8
    activations, channels [lo, hi). xsum: float32[M, K / 32]; mn: float32[N, K / 32];
    the rest as :func:`q4_0_q8_gemv_range`."""
    M = xq.shape[0]
    tiled = M - M % ROW_TILE
    pair = M - tiled >= 2
    for n in range(lo, hi):
        for m in range(0, tiled, ROW_TILE):
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = \
                _q4_1_x4(qs, n, xq, m, d, xd, mn, xsum)
        if pair:
            m = tiled
            out[m, n], out[m + 1, n] = _q4_1_x2(qs, n, xq, m, d, xd, mn, xsum)
        if M % 2:
            m = M - 1
            out[m, n] = _q4_1(qs, n, xq, m, d, xd, mn, xsum)


@njit(nogil=True, cache=True)
def q8_0_q8_gemv_range(xq, xd, qs, d, out, lo, hi):
    """Q8_0 weight (``w = d * qs``, qs: int8[N, K]) times Q8 activations,
    channels [lo, hi); the rest as :func:`q4_0_q8_gemv_range`."""
    M = xq.shape[0]
    tiled = M - M % ROW_TILE
    pair = M - tiled >= 2
    for n in range(lo, hi):
        for m in range(0, tiled, ROW_TILE):
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = \
                _q8_0_x4(qs, n, xq, m, d, xd)
        if pair:
            m = tiled
            out[m, n], out[m + 1, n] = _q8_0_x2(qs, n, xq, m, d, xd)
        if M % 2:
            m = M - 1
            out[m, n] = _q8_0(qs, n, xq, m, d, xd)


# --------------------------------------------------------------------------- #
# Parallel drivers: one prange iteration per contiguous range of channels
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True, parallel=True)
def q4_0_q8_gemv_parallel(xq, xd, qs, d, out, n_chunks):
    """:func:`q4_0_q8_gemv_range` over all N channels in ``n_chunks`` parallel ranges."""
    for c in prange(n_chunks):
        a, b = _chunk(c, n_chunks, 0, qs.shape[0])
        q4_0_q8_gemv_range(xq, xd, qs, d, out, a, b)


@njit(nogil=True, cache=True, parallel=True)
def q4_1_q8_gemv_parallel(xq, xd, xsum, qs, d, mn, out, n_chunks):
    """:func:`q4_1_q8_gemv_range` over all N channels in ``n_chunks`` parallel ranges."""
    for c in prange(n_chunks):
        a, b = _chunk(c, n_chunks, 0, qs.shape[0])
        q4_1_q8_gemv_range(xq, xd, xsum, qs, d, mn, out, a, b)


@njit(nogil=True, cache=True, parallel=True)
def q8_0_q8_gemv_parallel(xq, xd, qs, d, out, n_chunks):
    """:func:`q8_0_q8_gemv_range` over all N channels in ``n_chunks`` parallel ranges."""
    for c in prange(n_chunks):
        a, b = _chunk(c, n_chunks, 0, qs.shape[0])
        q8_0_q8_gemv_range(xq, xd, qs, d, out, a, b)
