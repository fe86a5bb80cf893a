"""The quantized KV cache's format (``--kv-cache-dtype int8``), backend-free.

One layer's cache is one array, as for float32, so that every path that
moves blocks (the offload tiers, the disaggregated transfer) moves a block
as stored, scales included:

- ``auto``: float32 ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``;
- ``int8``: int8 ``[num_blocks, 2, block_size, num_kv_heads, head_dim + 4]``.
  Each (block, K/V, slot, head) vector of ``head_dim`` values ``x`` is stored
  as ``head_dim`` int8 codes ``c`` followed by the 4 bytes of a little-endian
  float32 scale ``s``, and read back as ``c * s``, with

      ``s = max|x| / 127``,  ``c = clip(rint(x * (127 / max|x|)), -127, 127)``

  (round half to even; a zero vector has ``s = 0`` and zero codes).

A scale per (token, KV head) is llama.cpp's ``q8_0`` KV cache with blocks of
``head_dim`` instead of 32 values, and the per-token scales of KIVI
(Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache") for V; a vector is quantized once, when its token's K/V is written,
and never rescaled when later tokens of its block arrive (a scale per block
would have to be). Bytes per value: ``(head_dim + 4) / head_dim``, 1.0625 for
``head_dim`` 64: 0.266x of float32.

``fp8`` (vLLM's name) is accepted by the flag parser and refused at start-up
with one line: this build stores 8-bit K/V as int8 on both backends.

Helpers here are the NumPy reference the kernels are tested against. The
flag's values and byte arithmetic need no NumPy: ``kvserve.config`` (imported
by the CLI before it sets the thread-pool environment that NumPy reads at
import) uses them, so NumPy is imported inside the reference functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

#: ``--kv-cache-dtype`` values, vLLM's names.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
#: Bytes of the float32 scale after each int8 vector.
SCALE_BYTES = 4
#: Largest code magnitude (-128 is never written).
CODE_MAX = 127


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The validated ``--kv-cache-dtype``.

    Raises ValueError for a value outside ``KV_CACHE_DTYPES``, and for
    ``fp8``, which this build does not store (int8 is its 8-bit cache).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8":
        raise ValueError("--kv-cache-dtype fp8 is not built: use --kv-cache-dtype int8, "
                         "8-bit K/V with a float32 scale per token and KV head, on the CPU "
                         "and CUDA backends")
    return kv_cache_dtype


def is_quantized(kv_cache_dtype: str) -> bool:
    """Whether ``kv_cache_dtype`` stores codes and scales (``int8``)."""
    return kv_cache_dtype == "int8"


def vector_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Last dimension of a cache array: ``head_dim`` (``auto``) or
    ``head_dim + 4`` (``int8``: codes, then the scale's bytes).
    Raises ValueError when an int8 ``head_dim`` is not a multiple of 4
    (the scale would not be 4-byte aligned in a float32 view)."""
    if not is_quantized(kv_cache_dtype):
        return head_dim
    if head_dim % 4:
        raise ValueError(f"--kv-cache-dtype int8 needs head_dim divisible by 4, got {head_dim}")
    return head_dim + SCALE_BYTES


def bytes_per_value(kv_cache_dtype: str, head_dim: int, float_bytes: int = 4) -> float:
    """Bytes a cached K or V value costs, scales included: ``float_bytes``
    (the model dtype, ``auto``) or ``(head_dim + 4) / head_dim`` (``int8``)."""
    if not is_quantized(kv_cache_dtype):
        return float(float_bytes)
    return vector_width(head_dim, kv_cache_dtype) / head_dim


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       kv_cache_dtype: str = "auto", float_bytes: int = 4) -> int:
    """Bytes of K and V for one token over all layers, scales included:
    ``2 x layers x kv_heads x width`` with ``width`` = ``head_dim x
    float_bytes`` (``auto``, vLLM's sizing rule) or ``head_dim + 4`` (int8)."""
    if is_quantized(kv_cache_dtype):
        width = vector_width(head_dim, kv_cache_dtype)
    else:
        width = head_dim * float_bytes
    return 2 * num_layers * num_kv_heads * width


def quantize(x: np.ndarray) -> np.ndarray:
    """Reference quantization of float32 ``x[..., head_dim]`` to the stored
    int8 ``[..., head_dim + 4]`` (codes, then the scale's bytes)."""
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    hd = x.shape[-1]
    amax = np.abs(x).max(axis=-1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1.0))
    inv = np.where(amax > 0, np.float32(CODE_MAX) / safe, np.float32(0.0)).astype(np.float32)
    codes = np.clip(np.rint(x * inv), -CODE_MAX, CODE_MAX).astype(np.int8)
    scale = (amax / np.float32(CODE_MAX)).astype("<f4")
    out = np.empty(x.shape[:-1] + (hd + SCALE_BYTES,), dtype=np.int8)
    out[..., :hd] = codes
    out[..., hd:] = scale.view(np.int8).reshape(x.shape[:-1] + (SCALE_BYTES,))
    return out


def scales(stored: np.ndarray) -> np.ndarray:
    """float32 ``[...]`` scales of stored int8 ``[..., head_dim + 4]``."""
    import numpy as np

    stored = np.ascontiguousarray(stored)
    return stored[..., -SCALE_BYTES:].copy().view("<f4")[..., 0].astype(np.float32)


def dequantize(stored: np.ndarray) -> np.ndarray:
    """Reference float32 ``[..., head_dim]`` of stored int8 ``[..., head_dim + 4]``."""
    import numpy as np

    stored = np.asarray(stored)
    codes = stored[..., :-SCALE_BYTES].astype(np.float32)
    return codes * scales(stored)[..., None]
