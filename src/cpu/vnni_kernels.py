"""Numba kernels for many-row products of q4 block weights with Q8 activations, on VNNI.

``y = x @ W.T`` for a Q4_1 (or Q4_0, stored as ``m = -8 d``) weight ``W``
[N, K] and activations already quantized per block of 32 channels
(``block_dot_kernels.quantize_q8_blocks``: codes ``xq``, scales ``xd``,
``xsum = xd * sum(xq)``). Per weight block ``b`` of channel ``n`` and row
``m`` the result gains ``d[n, b] * xd[m, b] * I + mn[n, b] * xsum[m, b]``
with the exact int32 sum ``I = sum_j q_j * xq[m, 32 b + j]`` of the block's
32 unsigned nibble codes, the same products as ``block_dot_kernels`` (and
llama.cpp's ``ggml_vec_dot_q4_1_q8_1``); only the float summation order
differs.

The per-row kernels of ``block_dot_kernels`` put one channel in a vector
and reduce it horizontally, so every (channel, row, block) costs a
conversion, a scale and an FMA for 32 multiply-adds. Here a 512-bit vector
holds 16 channels (llama.cpp does the same with its repacked ``Q4_0x8``
layouts): a *panel* of 16 channels is repacked once per call so that 64
consecutive bytes hold codes ``4g .. 4g + 3`` of one block for the 16
channels, 4 bytes each, and one ``vpdpbusd`` (AVX512-VNNI: unsigned bytes
times signed bytes, four products summed into each int32 lane) adds four
products to each channel's block sum, the activation's 4 bytes broadcast
to every lane. Eight ``vpdpbusd`` finish a block for 16 channels, then one
conversion, one multiply and two FMAs give the 16 channels' float sums:
12 instructions for 512 multiply-adds, against 6 for 32 per row in
``block_dot_kernels``. A tile of ``ROWS`` activation rows shares each
panel load. No sum overflows: ``|I| <= 32 * 15 * 127``.

Where the CPU has no AVX512-VNNI (``CPU_HAS_VNNI`` False) the same code is
built with a generic four-byte dot product (zero- and sign-extend,
multiply, add each lane's four products), which LLVM lowers for any CPU:
correct, slower than ``block_dot_kernels``; the ops layer then does not
route products here, and the tests run it so that the layout and the
scales are checked on every machine.

Arrays must be C-contiguous with the dtypes given on each function
(``kvserve.cpu.block_dot_ops`` checks them); N a multiple of ``LANES``.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.core.extending import intrinsic

#: Channels of a panel (int32 lanes of a 512-bit vector).
LANES = 16
#: Input channels per block (ggml's QK4_1).
QK = 32
#: Groups of 4 codes per block (one ``vpdpbusd`` each).
GROUPS = QK // 4
#: Bytes of a repacked panel per block: 8 groups x 16 channels x 4 codes.
PANEL_BLOCK_BYTES = GROUPS * LANES * 4
#: Activation rows per register tile.
ROWS = 4


def _target_has_vnni() -> bool:
    """Whether Numba compiles for a CPU with AVX512-VNNI and AVX512-BW."""
    if numba_config.CPU_NAME or numba_config.CPU_FEATURES:
        features = numba_config.CPU_FEATURES or ""
        return "+avx512vnni" in features and "+avx512bw" in features
    try:
        host = llvm_binding.get_host_cpu_features()
    except RuntimeError:  # features unknown on this host
        return False
    return bool(host.get("avx512vnni", False) and host.get("avx512bw", False))


#: True when the panel kernels are built with ``vpdpbusd`` (else the generic
#: dot product). Read by the code generator only.
CPU_HAS_VNNI = _target_has_vnni()
#: Whether the ops route products to the panels (``block_dot_ops.uses_panels``,
#: ``decode_path``): ``CPU_HAS_VNNI``; a test may set it to check the routes,
#: the kernels then build the generic dot product.
HAS_VNNI = CPU_HAS_VNNI


# --------------------------------------------------------------------------- #
# Repacking: 16 channels' nibbles -> codes grouped for vpdpbusd
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def repack_q4_panel(qs, d, mn, n0, panel, dp, mp):
    """Repack channels ``n0 .. n0 + 15`` of a q4 weight for the panel kernel.

    qs: uint8[N, K / 2] (ggml nibbles: byte i of a block holds code i in its
    low nibble, code i + 16 in its high one); d, mn: float32[N, K / 32].
    Writes panel: uint8[K / 32 * PANEL_BLOCK_BYTES] with byte
    ``((b * 8 + g) * 16 + c) * 4 + t`` = code ``4 g + t`` of block b of
    channel ``n0 + c``; dp, mp: float32[K / 32, 16] = d, mn of those channels
    by block.
    """
    nb = d.shape[1]
    for c in range(LANES):
        n = n0 + c
        for b in range(nb):
            dp[b, c] = d[n, b]
            mp[b, c] = mn[n, b]
            src = 16 * b
            dst = b * PANEL_BLOCK_BYTES + 4 * c
            for g in range(GROUPS):
                o = dst + g * LANES * 4
                i = src + 4 * (g % 4)
                if g < 4:
                    for t in range(4):
                        panel[o + t] = qs[n, i + t] & 15
                else:
                    for t in range(4):
                        panel[o + t] = qs[n, i + t] >> 4


# --------------------------------------------------------------------------- #
# The tile: ROWS (or fewer) rows x 16 channels, the block loop in LLVM IR
# --------------------------------------------------------------------------- #

_i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat_value(builder, value, n):
    """<n x T> with every lane ``value``."""
    undef = ir.Constant(_vec(value.type, n), None)
    one = builder.insert_element(undef, value, _i32(0))
    return builder.shuffle_vector(one, undef, ir.Constant(_vec(_i32, n), [0] * n))


def _dot4_generic(builder, acc, w, x):
    """acc + per int32 lane the sum of 4 products of unsigned bytes of ``w``
    and signed bytes of ``x`` (all <16 x i32>), in plain IR."""
    wb = builder.zext(builder.bitcast(w, _vec(_i8, 64)), _vec(_i32, 64))
    xb = builder.sext(builder.bitcast(x, _vec(_i8, 64)), _vec(_i32, 64))
    p = builder.mul(wb, xb)
    total = acc
    for t in range(4):
        lane = builder.shuffle_vector(p, p, ir.Constant(_vec(_i32, LANES),
                                                         [4 * c + t for c in range(LANES)]))
        total = builder.add(total, lane)
    return total


def _tile_codegen(rows):
    """Codegen of ``out[m + r, n0 : n0 + 16] = sum over blocks`` for r < rows.

    Arguments (panel, dp, mp, xq, xd, xsum, out, m, n0, generic): panel
    uint8[nb * 512], dp, mp float32[nb, 16], xq int8[M, K], xd, xsum
    float32[M, nb], out float32[M, N], C-contiguous; ``generic`` (bool)
    takes the generic dot product even where ``vpdpbusd`` exists.
    """

    def codegen(context, builder, sig, args):
        def array(i):
            return context.make_array(sig.args[i])(context, builder, args[i])

        def row(a, r):  # pointer to row r of a C-contiguous 2-D array
            return builder.gep(a.data, [builder.mul(r, builder.extract_value(a.shape, 1))])

        panel, dp, mp, xq, xd, xsum, out = (array(i) for i in range(7))
        m, n0 = args[7], args[8]
        ms = [builder.add(m, m.type(r)) for r in range(rows)]
        x_rows = [row(xq, r) for r in ms]
        xd_rows, xsum_rows = [row(xd, r) for r in ms], [row(xsum, r) for r in ms]
        nb = builder.extract_value(dp.shape, 0)
        module = builder.module
        v16i, v16f = _vec(_i32, LANES), _vec(_f32, LANES)
        fmuladd = cgutils.get_or_insert_function(
            module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fmuladd.v16f32")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * LANES))
                for _ in range(rows)]
        zero = ir.Constant(v16i, [0] * LANES)

        def block_loop(vnni):
            if vnni:
                dpbusd = cgutils.get_or_insert_function(
                    module, ir.FunctionType(v16i, [v16i] * 3), "llvm.x86.avx512.vpdpbusd.512")
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                sums = [zero] * rows
                for g in range(GROUPS):
                    offset = builder.add(builder.mul(b, b.type(PANEL_BLOCK_BYTES)),
                                         b.type(g * LANES * 4))
                    wptr = builder.bitcast(builder.gep(panel.data, [offset]), v16i.as_pointer())
                    w = builder.load(wptr, align=1)
                    xo = builder.add(builder.mul(b, b.type(QK)), b.type(4 * g))
                    for r in range(rows):
                        xptr = builder.bitcast(builder.gep(x_rows[r], [xo]), _i32.as_pointer())
                        x = _splat_value(builder, builder.load(xptr, align=1), LANES)
                        sums[r] = (builder.call(dpbusd, [sums[r], w, x]) if vnni
                                   else _dot4_generic(builder, sums[r], w, x))
                dvec = builder.load(builder.bitcast(row(dp, b), v16f.as_pointer()), align=4)
                mvec = builder.load(builder.bitcast(row(mp, b), v16f.as_pointer()), align=4)
                for r in range(rows):
                    xd_b = _splat_value(builder, builder.load(builder.gep(xd_rows[r], [b])),
                                        LANES)
                    xs_b = _splat_value(builder, builder.load(builder.gep(xsum_rows[r], [b])),
                                        LANES)
                    acc = builder.call(fmuladd, [builder.sitofp(sums[r], v16f),
                                                 builder.fmul(dvec, xd_b),
                                                 builder.load(accs[r])])
                    builder.store(builder.call(fmuladd, [mvec, xs_b, acc]), accs[r])

        if CPU_HAS_VNNI:
            with builder.if_else(args[9]) as (generic, vnni):
                with generic:
                    block_loop(False)
                with vnni:
                    block_loop(True)
        else:  # the "vnni" tiles fall back: no function here fails to compile
            block_loop(False)
        for r in range(rows):
            dst = builder.gep(row(out, ms[r]), [n0])
            builder.store(builder.load(accs[r]), builder.bitcast(dst, v16f.as_pointer()),
                          align=4)
        return context.get_dummy_value()

    return codegen


def _tile_intrinsic(rows):
    def typer(typingctx, panel, dp, mp, xq, xd, xsum, out, m, n0, generic):
        return (types.none(panel, dp, mp, xq, xd, xsum, out, m, n0, generic),
                _tile_codegen(rows))
    typer.__name__ = f"_tile_{rows}"
    return intrinsic(typer)


_t1, _t2, _t3, _t4 = (_tile_intrinsic(r) for r in range(1, ROWS + 1))


@njit(nogil=True, cache=True, inline="always")
def _tile(rows, generic, panel, dp, mp, xq, xd, xsum, out, m, n0):
    """The tile of ``rows`` (1 to 4) rows from row m, channels n0 .. n0 + 15."""
    if rows == 4:
        _t4(panel, dp, mp, xq, xd, xsum, out, m, n0, generic)
    elif rows == 3:
        _t3(panel, dp, mp, xq, xd, xsum, out, m, n0, generic)
    elif rows == 2:
        _t2(panel, dp, mp, xq, xd, xsum, out, m, n0, generic)
    else:
        _t1(panel, dp, mp, xq, xd, xsum, out, m, n0, generic)


@njit(nogil=True, cache=True)
def q4_q8_panel_range(xq, xd, xsum, qs, d, mn, out, lo, hi, generic=False):
    """Channels [lo, hi) (multiples of 16) of ``out = x @ W.T`` for a q4
    weight and Q8 activations: each panel of 16 channels repacked once
    (:func:`repack_q4_panel`), then every row in tiles of 4 (a last tile of
    1 to 3 rows). ``generic``: the generic dot product even on a VNNI CPU.

    xq: int8[M, K]; xd, xsum: float32[M, K / 32]; qs: uint8[N, K / 2];
    d, mn: float32[N, K / 32] (Q4_0 as ``mn = -8 d``); out: float32[M, N].
    """
    M = xq.shape[0]
    nb = d.shape[1]
    panel = np.empty(nb * PANEL_BLOCK_BYTES, dtype=np.uint8)
    dp = np.empty((nb, LANES), dtype=np.float32)
    mp = np.empty((nb, LANES), dtype=np.float32)
    tiled = M - M % ROWS
    for n0 in range(lo, hi, LANES):
        repack_q4_panel(qs, d, mn, n0, panel, dp, mp)
        for m in range(0, tiled, ROWS):
            _tile(ROWS, generic, panel, dp, mp, xq, xd, xsum, out, m, n0)
        if M > tiled:
            _tile(M - tiled, generic, panel, dp, mp, xq, xd, xsum, out, tiled, n0)


@njit(nogil=True, cache=True)
def _panels(c, n_chunks, n):
    """Channels [lo, hi) of chunk c: whole 16-channel panels, spread evenly."""
    groups = n // LANES
    return LANES * (c * groups // n_chunks), LANES * ((c + 1) * groups // n_chunks)


@njit(nogil=True, cache=True, parallel=True)
def q4_q8_panel_parallel(xq, xd, xsum, qs, d, mn, out, n_chunks):
    """:func:`q4_q8_panel_range` over all N channels in ``n_chunks`` parallel
    ranges. xq: int8[M, K]; xd, xsum: float32[M, K / 32]; qs: uint8[N, K / 2];
    d, mn: float32[N, K / 32]; out: float32[M, N]; N a multiple of 16."""
    for c in prange(n_chunks):
        lo, hi = _panels(c, n_chunks, qs.shape[0])
        q4_q8_panel_range(xq, xd, xsum, qs, d, mn, out, lo, hi, False)
