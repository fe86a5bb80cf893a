"""Numba kernels for products of ggml block weights with Q8 activations, in panels of channels.

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
unpacks the nibbles. Here a vector holds ``LANES`` channels (L: 16 in a
512-bit vector with VNNI, 8 in a 256-bit one with AVX2; llama.cpp does the
same with its repacked ``Q4_0x8`` layouts). The weight is packed once
(``pack_panels``, a byte permutation of ggml's blocks): for each panel of L
channels and each block, 4 L consecutive bytes hold bytes ``4g .. 4g + 3``
of the block for the L channels, 4 each, so that their low nibbles are
codes ``4g .. 4g + 3`` and their high nibbles codes ``16 + 4g .. 16 + 4g +
3``. A four-byte dot product (unsigned bytes times signed bytes, four
products summed into each int32 lane) adds four products to each channel's
block sum, the activation's 4 bytes broadcast to every lane: one
``vpdpbusd`` with AVX512-VNNI, ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``
with AVX2. Per block and panel: 4 loads, 4 ``and`` and 4 shifts for the
nibbles (shared by a tile's rows), then per row 8 dot products, one
conversion, one multiply and two FMAs: with VNNI 12 instructions for 512
multiply-adds, against 6 for 32 per row in ``block_dot_kernels``. A tile of
``ROWS`` activation rows shares each load. No sum overflows: ``|I| <= 32 *
15 * 127``, and a pair of q4 products fits ``vpmaddubsw``'s int16. A Q8_0
weight (the LM head) takes the same kernel with its codes offset by 128
(``pack_panels``): 8 loads a block, no nibbles, ``|I| <= 32 * 255 * 127``;
with VNNI only (``HAS_Q8_PANELS``), as its pairs would saturate
``vpmaddubsw``.

What the assembly shows (``panel_q8_range.inspect_asm``, Zen 5, LLVM
``znver5`` via llvmlite 0.50 / Numba 0.68), the q4 loop of the 4-row tile
per block: 4 ``vmovdqu64`` of 64 packed bytes, 4 ``vpandq`` (low nibbles)
and 4 ``vgf2p8affineqb`` (LLVM's GFNI form of the byte shift: high
nibbles), then per row 8 ``vpdpbusd`` with the activation's 4 bytes as a
``{1to16}`` broadcast memory operand, one ``vcvtdq2ps``, one ``vmulps``
(``d`` times the broadcast ``xd``) and two ``vfmadd`` on zmm; no spills.
The Q8_0 loop is the same with 8 loads and no nibble split. The generic
dot product lowers to ``vpmovzxbd`` / ``vpmovsxbd``, ``vpmaddwd`` and
``vpermt2d`` shuffles, several times the instructions.

On a CPU with neither (``CPU_DOT`` None) the same code is built with a
generic four-byte dot product (zero- and sign-extend, multiply, add each
lane's four products), which LLVM lowers for any CPU: correct, slower than
``block_dot_kernels``; the ops layer then does not route products here
(``HAS_PANELS``), and the tests run the generic form on every machine
(``DOT_GENERIC``) so that the layout and the scales are checked anywhere,
and the AVX2 form wherever AVX2 exists (``DOT_AVX2``, VNNI CPUs included).

Arrays must be C-contiguous with the dtypes given on each function
(``kvserve.cpu.block_dot_ops`` checks them); N a multiple of ``LANES``.
In the shapes below L is ``LANES``.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.core.extending import intrinsic


def _target_features() -> dict[str, bool]:
    """The CPU features Numba compiles for (``NUMBA_CPU_FEATURES`` when set)."""
    if numba_config.CPU_NAME or numba_config.CPU_FEATURES:
        return {f[1:]: True for f in (numba_config.CPU_FEATURES or "").split(",")
                if f.startswith("+")}
    try:
        return dict(llvm_binding.get_host_cpu_features())
    except RuntimeError:  # features unknown on this host
        return {}


def _fast_dot(features: dict[str, bool]) -> str | None:
    """The four-byte dot product the CPU has: ``"vnni"`` (AVX512-VNNI and
    -BW: ``vpdpbusd`` on zmm), ``"avx2"`` (``vpmaddubsw`` + ``vpmaddwd`` on
    ymm), or None."""
    if features.get("avx512vnni") and features.get("avx512bw"):
        return "vnni"
    return "avx2" if features.get("avx2") else None


#: The CPU's fastest dot product, the panels' ``DOT_FAST`` form: ``"vnni"``,
#: ``"avx2"`` or None (then every form is the generic one).
CPU_DOT = _fast_dot(_target_features())
#: The panels' ``dot`` argument: the CPU's fastest form; the generic one (any
#: CPU); the AVX2 one (on a CPU with AVX2, VNNI ones included, so that tests
#: check it there too; the generic one elsewhere). Q8_0 weights never take
#: the AVX2 form (``HAS_Q8_PANELS``): it is the generic one for them.
DOT_FAST, DOT_GENERIC, DOT_AVX2 = 0, 1, 2
#: Channels of a panel: the int32 lanes of a 512-bit vector with VNNI, of a
#: 256-bit one otherwise.
LANES = 16 if CPU_DOT == "vnni" else 8
#: Input channels per block (ggml's QK4_1).
QK = 32
#: Bytes of a packed q4 panel per block: ggml's 16 bytes for each channel.
PANEL_BLOCK_BYTES = LANES * QK // 2
#: Activation rows per register tile.
ROWS = 4
#: Whether the ops route q4 products to the panels (``block_dot_ops.uses_panels``,
#: ``decode_path``); a test may set it to check the routes on any CPU.
HAS_PANELS = CPU_DOT is not None
#: The same for Q8_0 weights: VNNI only. Their codes are offset to unsigned
#: bytes, and a pair of those products can pass ``vpmaddubsw``'s int16
#: (``2 * 255 * 127``), so the AVX2 form would saturate.
HAS_Q8_PANELS = CPU_DOT == "vnni"


# --------------------------------------------------------------------------- #
# Packing: ggml's bytes of L channels interleaved in groups of 4
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def pack_panels(qs, d, mn, packed, dpm):
    """Pack a q4 or Q8_0 weight into panels of L channels for the panel kernels.

    q4: qs uint8[N, K / 2] (ggml nibbles: byte i of a block holds code i in
    its low nibble, code i + 16 in its high one), d and mn float32[N, K / 32].
    Writes packed: uint8[N / L, K / 32 * 16 L] with byte ``(b * 4 + g) * 4 L
    + 4 c + t`` of row G = byte ``16 b + 4 g + t`` of channel ``L G + c``
    (codes ``4 g + t`` and ``16 + 4 g + t`` of block b).

    Q8_0: qs int8[N, K], d float32[N, K / 32], mn ignored. The four-byte dot
    products multiply unsigned bytes by signed ones, so the codes are stored
    offset by 128 and the offset comes back through Q4_1's ``m`` term:
    ``sum_j (q_j + 128) x_j = I + 128 sum_j x_j``, so ``m = -128 d``
    (``xsum = xd * sum_j x_j``). packed: uint8[N / L, K / 32 * 32 L], byte
    ``(b * 8 + g) * 4 L + 4 c + t`` = ``qs[L G + c, 32 b + 4 g + t] + 128``.

    Both: dpm float32[N / L, K / 32 * 2 L] with ``[G, 2 L b + c]`` = d and ``[G, 2 L b
    + L + c]`` = m of that channel and block; N a multiple of L.
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
# The tile: ROWS (or fewer) rows x L channels, the block loop in LLVM IR
# --------------------------------------------------------------------------- #

_i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat_value(builder, value, n):
    """<n x T> with every lane ``value``."""
    undef = ir.Constant(_vec(value.type, n), None)
    one = builder.insert_element(undef, value, _i32(0))
    return builder.shuffle_vector(one, undef, ir.Constant(_vec(_i32, n), [0] * n))


def _dot4_generic(builder, acc, w, x, lanes=LANES):
    """acc + per int32 lane the sum of 4 products of unsigned bytes of ``w``
    and signed bytes of ``x`` (all <lanes x i32>), in plain IR."""
    wb = builder.zext(builder.bitcast(w, _vec(_i8, 4 * lanes)), _vec(_i32, 4 * lanes))
    xb = builder.sext(builder.bitcast(x, _vec(_i8, 4 * lanes)), _vec(_i32, 4 * lanes))
    p = builder.mul(wb, xb)
    total = acc
    for t in range(4):
        lane = builder.shuffle_vector(p, p, ir.Constant(_vec(_i32, lanes),
                                                         [4 * c + t for c in range(lanes)]))
        total = builder.add(total, lane)
    return total


def _dot4_avx2(builder, acc, w, x, lanes=LANES):
    """:func:`_dot4_generic` with ``vpmaddubsw`` (u8 x s8 -> int16 pair sums,
    saturating) and ``vpmaddwd`` by ones (-> int32 sums of 4) on ymm, each
    256-bit half of a wider vector apart; exact while a pair's sum fits
    int16 (q4 codes)."""
    v8i, v32b, v16s = _vec(_i32, 8), _vec(_i8, 32), _vec(ir.IntType(16), 16)
    maddubs = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v16s, [v32b, v32b]), "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v8i, [v16s, v16s]), "llvm.x86.avx2.pmadd.wd")
    halves = []
    for h in range(lanes // 8):
        half = ir.Constant(_vec(_i32, 8), list(range(8 * h, 8 * h + 8)))
        wh, xh = (builder.shuffle_vector(v, v, half) for v in (w, x))
        pairs = builder.call(maddubs, [builder.bitcast(wh, v32b), builder.bitcast(xh, v32b)])
        halves.append(builder.call(maddwd, [pairs, ir.Constant(v16s, [1] * 16)]))
    quads = halves[0] if len(halves) == 1 else builder.shuffle_vector(
        halves[0], halves[1], ir.Constant(_vec(_i32, 16), list(range(16))))
    return builder.add(acc, quads)


def _dot4_vnni(builder, acc, w, x, lanes=16):
    """:func:`_dot4_generic` as one ``vpdpbusd`` on zmm (``lanes`` 16 only)."""
    v16i = _vec(_i32, 16)
    dpbusd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v16i, [v16i] * 3), "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(dpbusd, [acc, w, x])


def emit_dot_forms(builder, dot, emit) -> None:
    """IR that runs ``emit(form)`` for the form the run-time ``dot`` argument
    names (``DOT_GENERIC``: None, ``DOT_AVX2``: ``"avx2"``, ``DOT_FAST``: the
    CPU's, ``CPU_DOT``); every form is the generic one without AVX2, so that
    no function fails to compile there."""
    def equals(value):
        return builder.icmp_signed("==", dot, dot.type(value))

    if CPU_DOT is None:
        emit(None)
        return
    with builder.if_else(equals(DOT_GENERIC)) as (generic, other):
        with generic:
            emit(None)
        with other:
            if CPU_DOT == "avx2":
                emit("avx2")
            else:
                with builder.if_else(equals(DOT_AVX2)) as (avx2, fast):
                    with avx2:
                        emit("avx2")
                    with fast:
                        emit(CPU_DOT)


def store_tile(builder, out_rows, n0, accs) -> None:
    """Store each accumulator ``accs[r]`` (an alloca of <L x float>) at
    element ``n0`` of output row pointer ``out_rows[r]`` (unaligned)."""
    for dst_row, acc in zip(out_rows, accs):
        value = builder.load(acc)
        dst = builder.bitcast(builder.gep(dst_row, [n0]), value.type.as_pointer())
        builder.store(value, dst, align=4)


#: The dot product of each form ``emit_dot_forms`` names.
DOT4 = {None: _dot4_generic, "avx2": _dot4_avx2, "vnni": _dot4_vnni}


def _weight_pieces(builder, w_row, b, q8, low_mask, four):
    """[(<L x i8 x 4> codes, first code)] of block b of the panel row at
    ``w_row``: q4: 4 loads, each split into low and high nibbles (masks
    ``low_mask``, shift ``four``); q8: 8 loads."""
    vbytes = _vec(_i8, 4 * LANES)
    pieces = []
    for g in range(8 if q8 else 4):
        offset = builder.add(builder.mul(b, b.type(PANEL_BLOCK_BYTES * (2 if q8 else 1))),
                             b.type(g * 4 * LANES))
        wptr = builder.bitcast(builder.gep(w_row, [offset]), vbytes.as_pointer())
        both = builder.load(wptr, align=1)
        if q8:
            pieces.append((both, 4 * g))
        else:
            pieces += [(builder.and_(both, low_mask), 4 * g),  # codes 4g + t
                       (builder.lshr(both, four), 16 + 4 * g)]  # codes 16 + 4g + t
    return pieces


def _tile_codegen(rows):
    """Codegen of ``out[m + r, n0 : n0 + L] = sum over blocks`` for r < rows.

    Arguments (packed, dpm, xq, xd, xsum, out, m, n0, dot): packed
    uint8[N / L, nb * 16 L] (q4) or [N / L, nb * 32 L] (Q8_0, told apart by
    that width) and dpm float32[N / L, nb * 2 L] (``pack_panels``), xq
    int8[M, K], xd, xsum float32[M, nb], out float32[M, N], C-contiguous; n0
    a multiple of L; ``dot`` (int): ``DOT_FAST``, ``DOT_GENERIC`` or
    ``DOT_AVX2``.
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
        vbytes, vint, vfloat = _vec(_i8, 4 * LANES), _vec(_i32, LANES), _vec(_f32, LANES)
        fmuladd = cgutils.get_or_insert_function(
            module, ir.FunctionType(vfloat, [vfloat] * 3), f"llvm.fmuladd.v{LANES}f32")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vfloat, [0.0] * LANES))
                for _ in range(rows)]
        zero = ir.Constant(vint, [0] * LANES)
        low_mask = ir.Constant(vbytes, [15] * 4 * LANES)
        four = ir.Constant(vbytes, [4] * 4 * LANES)

        # Q8_0 panels have twice the bytes per block of q4 ones
        is_q8 = builder.icmp_unsigned("==", builder.extract_value(packed.shape, 1),
                                      builder.mul(nb, nb.type(2 * PANEL_BLOCK_BYTES)))

        def block_loop(form, q8):
            # AVX2's pairs of offset Q8_0 products could saturate: generic there
            dot4 = {"vnni": _dot4_vnni, "avx2": _dot4_avx2}.get(form, _dot4_generic)
            if q8 and form == "avx2":
                dot4 = _dot4_generic
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                sums = [zero] * rows
                for codes, first in _weight_pieces(builder, w_row, b, q8,
                                                   low_mask, four):
                    w = builder.bitcast(codes, vint)
                    xo = builder.add(builder.mul(b, b.type(QK)), b.type(first))
                    for r in range(rows):
                        xptr = builder.bitcast(builder.gep(x_rows[r], [xo]), _i32.as_pointer())
                        x = _splat_value(builder, builder.load(xptr, align=1), LANES)
                        sums[r] = dot4(builder, sums[r], w, x)
                scales = builder.mul(b, b.type(2 * LANES))
                dvec = builder.load(builder.bitcast(builder.gep(s_row, [scales]),
                                                    vfloat.as_pointer()), align=4)
                mvec = builder.load(builder.bitcast(
                    builder.gep(s_row, [builder.add(scales, b.type(LANES))]),
                    vfloat.as_pointer()), align=4)
                for r in range(rows):
                    xd_b = _splat_value(builder, builder.load(builder.gep(xd_rows[r], [b])),
                                        LANES)
                    xs_b = _splat_value(builder, builder.load(builder.gep(xsum_rows[r], [b])),
                                        LANES)
                    acc = builder.call(fmuladd, [builder.sitofp(sums[r], vfloat),
                                                 builder.fmul(dvec, xd_b),
                                                 builder.load(accs[r])])
                    builder.store(builder.call(fmuladd, [mvec, xs_b, acc]), accs[r])

        def both_kinds(form):
            with builder.if_else(is_q8) as (q8, q4):
                with q8:
                    block_loop(form, True)
                with q4:
                    block_loop(form, False)

        # the forms by the ``dot`` argument; without AVX2 every form is the
        # generic one, so that no function here fails to compile
        dot = args[8]

        emit_dot_forms(builder, dot, both_kinds)
        store_tile(builder, [row(out, r) for r in ms], n0, accs)
        return context.get_dummy_value()

    return codegen


def _tile_intrinsic(rows):
    def typer(typingctx, packed, dpm, xq, xd, xsum, out, m, n0, dot):
        return (types.none(packed, dpm, xq, xd, xsum, out, m, n0, dot),
                _tile_codegen(rows))
    typer.__name__ = f"_tile_{rows}"
    return intrinsic(typer)


_t1, _t2, _t3, _t4 = (_tile_intrinsic(r) for r in range(1, ROWS + 1))


@njit(nogil=True, cache=True, inline="always")
def _tile(rows, dot, packed, dpm, xq, xd, xsum, out, m, n0):
    """The tile of ``rows`` (1 to 4) rows from row m, channels n0 .. n0 + L - 1."""
    if rows == 4:
        _t4(packed, dpm, xq, xd, xsum, out, m, n0, dot)
    elif rows == 3:
        _t3(packed, dpm, xq, xd, xsum, out, m, n0, dot)
    elif rows == 2:
        _t2(packed, dpm, xq, xd, xsum, out, m, n0, dot)
    else:
        _t1(packed, dpm, xq, xd, xsum, out, m, n0, dot)


@njit(nogil=True, cache=True)
def panel_q8_range(xq, xd, xsum, packed, dpm, out, lo, hi, dot=DOT_FAST):
    """Channels [lo, hi) (multiples of L) of ``out = x @ W.T`` for a q4
    weight packed by `pack_panels` (or a Q8_0 one by
    `pack_panels`) and Q8 activations: each panel's
    rows in tiles of 4 (a last tile of 1 to 3 rows). ``dot``: ``DOT_FAST``
    (the CPU's fastest form), ``DOT_GENERIC`` or ``DOT_AVX2``.

    xq: int8[M, K]; xd, xsum: float32[M, K / 32]; packed: uint8[N / L,
    K / 32 * 16 L] (q4) or [N / L, K / 32 * 32 L] (Q8_0); dpm: float32[N / L,
    K / 32 * 2 L]; out: float32[M, N].
    """
    M = xq.shape[0]
    tiled = M - M % ROWS
    for n0 in range(lo, hi, LANES):
        for m in range(0, tiled, ROWS):
            _tile(ROWS, dot, packed, dpm, xq, xd, xsum, out, m, n0)
        if M > tiled:
            _tile(M - tiled, dot, packed, dpm, xq, xd, xsum, out, tiled, n0)


@njit(nogil=True, cache=True)
def _panels(c, n_chunks, n):
    """Channels [lo, hi) of chunk c: whole panels of L channels, spread evenly."""
    groups = n // LANES
    return LANES * (c * groups // n_chunks), LANES * ((c + 1) * groups // n_chunks)


@njit(nogil=True, cache=True, parallel=True)
def panel_q8_parallel(xq, xd, xsum, packed, dpm, out, n_chunks):
    """:func:`panel_q8_range` over all N channels in ``n_chunks`` parallel
    ranges of whole panels (arguments as there)."""
    for c in prange(n_chunks):
        lo, hi = _panels(c, n_chunks, out.shape[1])
        panel_q8_range(xq, xd, xsum, packed, dpm, out, lo, hi, DOT_FAST)
