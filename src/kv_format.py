"""The KV cache's storage format as numbers: the ``--kv-cache-dtype`` values
and the bytes a cached vector, value and token cost, scales included.

Standard library only, so that ``kvserve.config`` (below every other layer)
can size and check a cache; the format itself and its NumPy reference are
``kvserve.model.kv_quant``.
"""

from __future__ import annotations

#: ``--kv-cache-dtype`` values, vLLM's names.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
#: Bytes of the float32 scale after each int8 vector.
SCALE_BYTES = 4


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
