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
flag's values and byte arithmetic are ``kvserve.kv_format`` (standard library
only, for ``kvserve.config``), re-exported here; NumPy is imported inside the
reference functions (the CLI imports this module before it sets the
thread-pool environment that NumPy reads at import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.kv_format import (KV_CACHE_DTYPES, SCALE_BYTES, bytes_per_value,
                               check_kv_cache_dtype, is_quantized, kv_bytes_per_token,
                               vector_width)

if TYPE_CHECKING:
    import numpy as np

#: The flag's values and byte arithmetic live in ``kvserve.kv_format``; re-exported.
__all__ = ["CODE_MAX", "KV_CACHE_DTYPES", "SCALE_BYTES", "bytes_per_value",
           "check_kv_cache_dtype", "dequantize", "is_quantized", "kv_bytes_per_token",
           "quantize", "scales", "vector_width"]
#: Largest code magnitude (-128 is never written).
CODE_MAX = 127


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
