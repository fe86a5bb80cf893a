"""llama.cpp's block-quantized weights (Q4_0, Q4_1, Q8_0), kept as the GGUF ships them.

``--quantization q4`` serves the linear layers, the embedding table and the
(tied) LM head from the bytes of the model's GGUF file instead of the float
checkpoint converted from it. The block formats are ggml's
(``ggml-common.h``, ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``): each run
of ``QK = 32`` consecutive input channels of a row is one block,

- ``Q4_0``: float16 ``d``, 16 bytes of 4-bit codes; ``w = d * (q - 8)``;
- ``Q4_1``: float16 ``d``, float16 ``m``, 16 bytes; ``w = d * q + m``;
- ``Q8_0``: float16 ``d``, 32 int8 codes; ``w = d * q``.

In a 4-bit block, byte ``j`` holds channel ``j`` in its low nibble and
channel ``j + 16`` in its high nibble.

:class:`BlockQuantizedWeight` splits the blocks into arrays a kernel can
stream: the codes exactly as stored (``uint8[N, K / 2]`` of nibble pairs,
or ``int8[N, K]``), and the block scales widened from float16 to float32
(``float32[N, K / 32]``; NumPy and Numba have no fast float16 arithmetic on
the CPU), so 24 bytes per 32 weights for Q4 where the file has 20. A Q4_0
block gets ``m = -8 d``, which makes it a Q4_1 block of the same values
(``d * q - 8 d``; ``8 d`` is exact in float32), so one kernel serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Input channels per block (ggml's QK4_0 = QK4_1 = QK8_0).
QK = 32
#: The GGUF tensor types served as blocks, and the kernel form each becomes.
BLOCK_KINDS = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8"}
#: Bytes of one block in the file, per GGUF type.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class BlockQuantizedWeight:
    """A ``[N out, K in]`` weight in ggml blocks of ``QK`` input channels.

    ``kind`` ``q4``: ``qs`` uint8[N, K / 2] (byte ``16 b + j`` of a row holds
    channels ``32 b + j`` (low nibble) and ``32 b + 16 + j`` (high)),
    ``d`` and ``m`` float32[N, K / 32]; ``W[n, 32 b + i] = d[n, b] * q + m[n, b]``.
    ``kind`` ``q8``: ``qs`` int8[N, K], ``d`` float32[N, K / 32], ``m`` None;
    ``W[n, 32 b + i] = d[n, b] * qs[n, 32 b + i]``. ``ggml_type``: the GGUF
    type it came from (``Q4_0``, ``Q4_1``, ``Q8_0``), for logs.
    ``activations``: how the CPU backend multiplies it: ``float`` (dequantized
    weights times float32 activations; ``--quantization q4``) or ``q8``
    (``w4a8``: the activations of small products quantized to Q8 blocks,
    ``kvserve.cpu.block_dot_ops``).
    """

    kind: str
    qs: Any
    d: Any
    m: Any
    ggml_type: str
    activations: str = "float"

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``, as the dense weight's."""
        return int(self.d.shape[0]), int(self.d.shape[1]) * QK

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales as held (float32 scales)."""
        return int(sum(a.nbytes for a in (self.qs, self.d, self.m) if a is not None))

    def map(self, fn) -> BlockQuantizedWeight:
        """The same weight with ``fn`` applied to each array (``m`` None stays None):
        a row permutation, a row slice, a transfer to a backend."""
        return BlockQuantizedWeight(self.kind, fn(self.qs), fn(self.d),
                                    None if self.m is None else fn(self.m), self.ggml_type,
                                    self.activations)


def from_gguf_bytes(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> BlockQuantizedWeight:
    """Split a GGUF tensor's bytes into a :class:`BlockQuantizedWeight`.

    Args:
        raw: uint8, the tensor's bytes (any shape; N * K / 32 blocks in row order).
        ggml_type: ``Q4_0``, ``Q4_1`` or ``Q8_0``.
        shape: ``(N, K)`` of the weight, numpy order (the GGUF lists it reversed).

    Raises:
        ValueError: another type, K not a multiple of 32, or a byte count
            that does not match the shape.
    """
    if ggml_type not in _BLOCK_BYTES:
        raise ValueError(f"{ggml_type} is not a block type kvserve serves "
                         f"(one of {', '.join(_BLOCK_BYTES)})")
    n, k = shape
    size = _BLOCK_BYTES[ggml_type]
    if k % QK or raw.size != n * (k // QK) * size:
        raise ValueError(f"{ggml_type} tensor of shape {shape}: {raw.size} bytes, expected "
                         f"{n * (k // QK) * size} (K a multiple of {QK})")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QK, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if ggml_type == "Q8_0":
        qs = blocks[:, :, 2:].copy().view(np.int8).reshape(n, k)
        return BlockQuantizedWeight("q8", qs, d, None, ggml_type)
    if ggml_type == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
        codes = blocks[:, :, 4:]
    else:  # Q4_0: w = d * (q - 8) = d * q + (-8 d)
        m = d * np.float32(-8.0)
        codes = blocks[:, :, 2:]
    return BlockQuantizedWeight("q4", np.ascontiguousarray(codes).reshape(n, k // 2), d, m,
                                ggml_type)


def unpack_codes(w: BlockQuantizedWeight) -> np.ndarray:
    """The integer codes of a host weight as float32[N, K] (4-bit: 0..15; 8-bit: -128..127)."""
    if w.kind == "q8":
        return w.qs.astype(np.float32)
    n, half = w.qs.shape
    pairs = w.qs.reshape(n, half // 16, 16)
    lo, hi = pairs & np.uint8(15), pairs >> np.uint8(4)
    return np.concatenate([lo, hi], axis=2).reshape(n, half * 2).astype(np.float32)


def dequantize(w: BlockQuantizedWeight, rows: np.ndarray | None = None) -> np.ndarray:
    """float32[N, K] (or float32[len(rows), K]) values of a host weight (the reference
    every block kernel is tested against)."""
    if rows is not None:
        w = w.map(lambda a: a[rows])
    n, k = w.shape
    codes = unpack_codes(w).reshape(n, k // QK, QK)
    out = codes * w.d[:, :, None]
    if w.m is not None:
        out += w.m[:, :, None]
    return out.reshape(n, k)


def concat_rows(weights: list[BlockQuantizedWeight]) -> BlockQuantizedWeight:
    """Stack host weights of one kind along N (fusing q/k/v or gate/up).

    Raises ValueError for mixed kinds or input widths.
    """
    kinds = {(w.kind, w.shape[1]) for w in weights}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse block weights of different kinds or widths: "
                         f"{[(w.ggml_type, w.shape) for w in weights]}")
    m = None if weights[0].m is None else np.concatenate([w.m for w in weights])
    return BlockQuantizedWeight(weights[0].kind, np.concatenate([w.qs for w in weights]),
                                np.concatenate([w.d for w in weights]), m,
                                "+".join(sorted({w.ggml_type for w in weights})))




@dataclass(frozen=True)
class KQuantWeight:
    """A ``[N out, K in]`` weight in llama.cpp K-quant super-blocks (Q4_K,
    Q5_K, Q6_K), packed in panels of 16 channels for the CPU kernels
    (``kvserve.cpu.kquant_kernels``, whose docstring gives the formats).

    ``codes``, ``scales``, ``mins``: uint8 and ``dd``: float32 panel arrays
    (``kquant_kernels.packed_shapes`` of the padded N; None for a table used
    only as an embedding), usually views of a mapped file; ``raw``:
    uint8[N, K / 256, block bytes], the GGUF's own super-blocks (a view of
    the mapped file: the embedding's row lookups), or None. ``n`` is the
    weight's N; the panels may hold up to 15 zero channels more (N padded
    to a multiple of 16). ``ggml_type``: ``Q4_K``, ``Q5_K`` or ``Q6_K``.
    """

    ggml_type: str
    n: int
    k: int
    codes: Any
    scales: Any
    mins: Any
    dd: Any
    raw: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``, as the dense weight's."""
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        """Bytes of the panels (the mapped GGUF bytes of ``raw`` not counted)."""
        return int(sum(a.nbytes for a in (self.codes, self.scales, self.mins, self.dd)
                       if a is not None))


@dataclass(frozen=True)
class StackedWeight:
    """Weights whose outputs are concatenated: ``x @ [W_0; W_1; ...].T``.

    What a fused projection (q/k/v, gate/up) becomes when a part is a
    K-quant weight (a Q4_K_M file's Q4_K ``attn_q`` and Q6_K ``attn_v``):
    no part is dequantized or copied (the panels stay views of their mapped
    file), and the products share one quantization of ``x``. ``parts``: the
    ``[N_i, K]`` weights, in output order."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        """``(sum N_i, K)``."""
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of every part."""
        return int(sum(p.nbytes for p in self.parts))



def fuse_adjacent(weights: list[KQuantWeight]) -> KQuantWeight | None:
    """One ``KQuantWeight`` viewing ``weights`` stacked along N, when their
    panel arrays lie end to end in memory (``gguf_weights`` writes a layer's
    q/k/v and gate/up parts so); None when they are not of one type and K,
    an N but the last is not a multiple of 16, or the arrays are not
    adjacent. No byte is copied."""
    first = weights[0]
    if any(w.ggml_type != first.ggml_type or w.k != first.k or w.codes is None
           for w in weights) or any(w.n % 16 for w in weights[:-1]):
        return None
    fused = []
    for key in ("codes", "scales", "mins", "dd"):
        arrays = [getattr(w, key) for w in weights]
        for a, b in zip(arrays, arrays[1:]):
            if (a.dtype != b.dtype or a.shape[1] != b.shape[1] or not a.flags.c_contiguous
                    or a.ctypes.data + a.nbytes != b.ctypes.data):
                return None
        rows = sum(a.shape[0] for a in arrays)
        fused.append(np.lib.stride_tricks.as_strided(arrays[0], (rows, arrays[0].shape[1]),
                                                     arrays[0].strides))
    return KQuantWeight(first.ggml_type, sum(w.n for w in weights), first.k, *fused)
