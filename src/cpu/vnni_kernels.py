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
conversion, a scale and an FMA for 32 multiply-adds, and a lone row also
unpacks the nibbles. Here a 512-bit vector holds 16 channels (llama.cpp
does the same with its repacked ``Q4_0x8`` layouts). The weight is packed
once (`pack_panels`, a byte permutation of ggml's blocks): for
each panel of 16 channels and each block, 64 consecutive bytes hold bytes
``4g .. 4g + 3`` of the block for the 16 channels, 4 each, so that their
low nibbles are codes ``4g .. 4g + 3`` and their high nibbles codes
``16 + 4g .. 16 + 4g + 3``. One ``vpdpbusd`` (AVX512-VNNI: unsigned bytes
times signed bytes, four products summed into each int32 lane) adds four
products to each channel's block sum, the activation's 4 bytes broadcast
to every lane. Per block and 16 channels: 4 loads, 4 ``vpandd`` and 4
shifts for the nibbles (shared by a tile's rows), then per row 8
``vpdpbusd``, one conversion, one multiply and two FMAs: 12 instructions
for 512 multiply-adds, against 6 for 32 per row in ``block_dot_kernels``.
A tile of ``ROWS`` activation rows shares each load. No sum overflows:
``|I| <= 32 * 15 * 127``. A Q8_0 weight (the LM head) takes the same
kernel with its codes offset by 128 (`pack_panels`): 8 loads a
block, no nibbles, ``|I| <= 32 * 255 * 127``.

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
#: Bytes of a packed panel per block: ggml's 16 bytes for each of 16 channels.
PANEL_BLOCK_BYTES = LANES * QK // 2
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
# Packing: ggml's bytes of 16 channels interleaved in groups of 4
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def pack_panels(qs, d, mn, packed, dpm):
    """Pack a q4 or Q8_0 weight into panels of 16 channels for the panel kernels.

    q4: qs uint8[N, K / 2] (ggml nibbles: byte i of a block holds code i in
    its low nibble, code i + 16 in its high one), d and mn float32[N, K / 32].
    Writes packed: uint8[N / 16, K / 32 * 256] with byte ``(b * 4 + g) * 64
    + 4 c + t`` of row G = byte ``16 b + 4 g + t`` of channel ``16 G + c``
    (codes ``4 g + t`` and ``16 + 4 g + t`` of block b).

    Q8_0: qs int8[N, K], d float32[N, K / 32], mn ignored. ``vpdpbusd``
    multiplies unsigned bytes by signed ones, so the codes are stored offset
    by 128 and the offset comes back through Q4_1's ``m`` term:
    ``sum_j (q_j + 128) x_j = I + 128 sum_j x_j``, so ``m = -128 d``
    (``xsum = xd * sum_j x_j``). packed: uint8[N / 16, K / 32 * 512], byte
    ``(b * 8 + g) * 64 + 4 c + t`` = ``qs[16 G + c, 32 b + 4 g + t] + 128``.

    Both: dpm float32[N / 16, K] with ``[G, 32 b + c]`` = d and ``[G, 32 b +
    16 + c]`` = m of that channel and block; N a multiple of 16.
    """
    nb = d.shape[1]
    width = qs.shape[1] // nb  # bytes of a channel's block: 16 (q4) or 32 (Q8_0)
    q8 = width == QK
    for G in range(qs.shape[0] // LANES):
        for c in range(LANES):
            n = LANES * G + c
            for b in range(nb):
                dpm[G, 2 * LANES * b + c] = d[n, b]
                dpm[G, 2 * LANES * b + LANES + c] = np.float32(-128.0) * d[n, b] if q8 \
                    else mn[n, b]
                for g in range(width // 4):
                    for t in range(4):
                        code = np.int32(qs[n, width * b + 4 * g + t])
                        packed[G, (width // 4 * b + g) * 4 * LANES + 4 * c + t] = np.uint8(
                            code + 128 if q8 else code)


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

    Arguments (packed, dpm, xq, xd, xsum, out, m, n0, generic): packed
    uint8[N / 16, nb * 256] and dpm float32[N / 16, nb * 32]
    (`pack_panels`; [N / 16, nb * 512] from `pack_panels`,
    told apart by that width), xq int8[M, K], xd, xsum float32[M, nb], out
    float32[M, N], C-contiguous; n0 a multiple of 16; ``generic`` (bool)
    takes the generic dot product even where ``vpdpbusd`` exists.
    """

    def codegen(context, builder, sig, args):
        def array(i):
            return context.make_array(sig.args[i])(context, builder, args[i])

        def row(a, r):  # pointer to row r of a C-contiguous 2-D array
            return builder.gep(a.data, [builder.mul(r, builder.extract_value(a.shape, 1))])

        packed, dpm, xq, xd, xsum, out = (array(i) for i in range(6))
        m, n0 = args[6], args[7]
        panel = builder.udiv(n0, n0.type(LANES))
        w_row, s_row = row(packed, panel), row(dpm, panel)
        ms = [builder.add(m, m.type(r)) for r in range(rows)]
        x_rows = [row(xq, r) for r in ms]
        xd_rows, xsum_rows = [row(xd, r) for r in ms], [row(xsum, r) for r in ms]
        nb = builder.extract_value(xd.shape, 1)
        module = builder.module
        v64b, v16i, v16f = _vec(_i8, 64), _vec(_i32, LANES), _vec(_f32, LANES)
        fmuladd = cgutils.get_or_insert_function(
            module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fmuladd.v16f32")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * LANES))
                for _ in range(rows)]
        zero = ir.Constant(v16i, [0] * LANES)
        low_mask = ir.Constant(v64b, [15] * 64)
        four = ir.Constant(v64b, [4] * 64)

        # Q8_0 panels have twice the bytes per block of q4 ones
        is_q8 = builder.icmp_unsigned("==", builder.extract_value(packed.shape, 1),
                                      builder.mul(nb, nb.type(2 * PANEL_BLOCK_BYTES)))

        def weight_pieces(b, q8):
            """[(<16 x i32> codes, first code)] of block b: q4: 4 loads, each
            split into low and high nibbles; q8: 8 loads."""
            pieces = []
            for g in range(8 if q8 else 4):
                offset = builder.add(builder.mul(b, b.type(PANEL_BLOCK_BYTES * (2 if q8 else 1))),
                                     b.type(g * 4 * LANES))
                wptr = builder.bitcast(builder.gep(w_row, [offset]), v64b.as_pointer())
                both = builder.load(wptr, align=1)
                if q8:
                    pieces.append((both, 4 * g))
                else:
                    pieces += [(builder.and_(both, low_mask), 4 * g),  # codes 4g + t
                               (builder.lshr(both, four), 16 + 4 * g)]  # codes 16 + 4g + t
            return pieces

        def block_loop(vnni, q8):
            if vnni:
                dpbusd = cgutils.get_or_insert_function(
                    module, ir.FunctionType(v16i, [v16i] * 3), "llvm.x86.avx512.vpdpbusd.512")
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                sums = [zero] * rows
                for codes, first in weight_pieces(b, q8):
                    w = builder.bitcast(codes, v16i)
                    xo = builder.add(builder.mul(b, b.type(QK)), b.type(first))
                    for r in range(rows):
                        xptr = builder.bitcast(builder.gep(x_rows[r], [xo]), _i32.as_pointer())
                        x = _splat_value(builder, builder.load(xptr, align=1), LANES)
                        sums[r] = (builder.call(dpbusd, [sums[r], w, x]) if vnni
                                   else _dot4_generic(builder, sums[r], w, x))
                scales = builder.mul(b, b.type(2 * LANES))
                dvec = builder.load(builder.bitcast(builder.gep(s_row, [scales]),
                                                    v16f.as_pointer()), align=4)
                mvec = builder.load(builder.bitcast(
                    builder.gep(s_row, [builder.add(scales, b.type(LANES))]),
                    v16f.as_pointer()), align=4)
                for r in range(rows):
                    xd_b = _splat_value(builder, builder.load(builder.gep(xd_rows[r], [b])),
                                        LANES)
                    xs_b = _splat_value(builder, builder.load(builder.gep(xsum_rows[r], [b])),
                                        LANES)
                    acc = builder.call(fmuladd, [builder.sitofp(sums[r], v16f),
                                                 builder.fmul(dvec, xd_b),
                                                 builder.load(accs[r])])
                    builder.store(builder.call(fmuladd, [mvec, xs_b, acc]), accs[r])

        def both_kinds(vnni):
            with builder.if_else(is_q8) as (q8, q4):
                with q8:
                    block_loop(vnni, True)
                with q4:
                    block_loop(vnni, False)

        if CPU_HAS_VNNI:
            with builder.if_else(args[8]) as (generic, vnni):
                with generic:
                    both_kinds(False)
                with vnni:
                    both_kinds(True)
        else:  # the "vnni" tiles fall back: no function here fails to compile
            both_kinds(False)
        for r in range(rows):
            dst = builder.gep(row(out, ms[r]), [n0])
            builder.store(builder.load(accs[r]), builder.bitcast(dst, v16f.as_pointer()),
                          align=4)
        return context.get_dummy_value()

    return codegen


def _tile_intrinsic(rows):
    def typer(typingctx, packed, dpm, xq, xd, xsum, out, m, n0, generic):
        return (types.none(packed, dpm, xq, xd, xsum, out, m, n0, generic),
                _tile_codegen(rows))
    typer.__name__ = f"_tile_{rows}"
    return intrinsic(typer)


_t1, _t2, _t3, _t4 = (_tile_intrinsic(r) for r in range(1, ROWS + 1))


@njit(nogil=True, cache=True, inline="always")
def _tile(rows, generic, packed, dpm, xq, xd, xsum, out, m, n0):
    """The tile of ``rows`` (1 to 4) rows from row m, channels n0 .. n0 + 15."""
    if rows == 4:
        _t4(packed, dpm, xq, xd, xsum, out, m, n0, generic)
    elif rows == 3:
        _t3(packed, dpm, xq, xd, xsum, out, m, n0, generic)
    elif rows == 2:
        _t2(packed, dpm, xq, xd, xsum, out, m, n0, generic)
    else:
        _t1(packed, dpm, xq, xd, xsum, out, m, n0, generic)


@njit(nogil=True, cache=True)
def panel_q8_range(xq, xd, xsum, packed, dpm, out, lo, hi, generic=False):
    """Channels [lo, hi) (multiples of 16) of ``out = x @ W.T`` for a q4
    weight packed by `pack_panels` (or a Q8_0 one by
    `pack_panels`) and Q8 activations: each panel's
    rows in tiles of 4 (a last tile of 1 to 3 rows). ``generic``: the
    generic dot product even on a VNNI CPU.

    xq: int8[M, K]; xd, xsum: float32[M, K / 32]; packed: uint8[N / 16,
    K / 32 * 256] (q4) or [N / 16, K / 32 * 512] (Q8_0); dpm: float32[N / 16,
    K]; out: float32[M, N].
    """
    M = xq.shape[0]
    tiled = M - M % ROWS
    for n0 in range(lo, hi, LANES):
        for m in range(0, tiled, ROWS):
            _tile(ROWS, generic, packed, dpm, xq, xd, xsum, out, m, n0)
        if M > tiled:
            _tile(M - tiled, generic, packed, dpm, xq, xd, xsum, out, tiled, n0)


@njit(nogil=True, cache=True)
def _panels(c, n_chunks, n):
    """Channels [lo, hi) of chunk c: whole 16-channel panels, spread evenly."""
    groups = n // LANES
    return LANES * (c * groups // n_chunks), LANES * ((c + 1) * groups // n_chunks)


@njit(nogil=True, cache=True, parallel=True)
def panel_q8_parallel(xq, xd, xsum, packed, dpm, out, n_chunks):
    """:func:`panel_q8_range` over all N channels in ``n_chunks`` parallel
    ranges of whole panels (arguments as there)."""
    for c in prange(n_chunks):
        lo, hi = _panels(c, n_chunks, out.shape[1])
        panel_q8_range(xq, xd, xsum, packed, dpm, out, lo, hi, False)
