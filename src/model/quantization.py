"""Weight quantization at load time: symmetric int8 per output channel.

``--quantization`` schemes (vLLM's names where vLLM has them):

- ``none``: float weights (the backend's dtype).
- ``int8``: weight-only int8. Each linear layer's ``W [out, in]`` becomes
  ``qweight int8[out, in]`` and ``scales float32[out]`` with
  ``scale[n] = max_k |W[n, k]| / 127`` and ``qweight = round(W / scale)``
  (round half to even), so ``W ~ qweight * scales[:, None]`` with an error of
  at most ``scale / 2`` per element. Activations stay float (LLM.int8's
  per-channel absmax scheme without its outlier path; Dettmers et al. 2022).
- ``w8a8``: the same weights, and each activation row (token) quantized
  dynamically to int8 with an absmax scale per group of 64 input channels
  before int32-accumulated products (SmoothQuant's per-token / per-channel
  symmetric scheme, Xiao et al. 2023, with group-wise activation scales
  instead of its smoothing: one scale per token cost the default model 9.9%
  of perplexity, groups of 64 cost 1.7%; ``kvserve.cpu.int8``).

- ``q4``: the model's GGUF blocks as they ship (``kvserve.model.ggml_blocks``):
  Q4_0 / Q4_1 / Q8_0 codes with their per-32-channel scales, for every
  tensor the file stores in those types: for the default model the
  projections (Q4_1) and the tied embedding / LM head table (Q8_0).
  Activations stay float32. Not a load-time quantization: the checkpoint
  folder must hold the ``.gguf`` it was converted from
  (``kvserve.model.loader.find_gguf``).
- ``w4a8``: ``q4``'s weights, and in products of at most
  ``kvserve.cpu.block_dot_ops.Q8_MAX_ROWS`` rows (decode steps) the
  activations quantized per block of 32 channels to int8 with a float32
  scale before integer block products (llama.cpp's CPU scheme: Q8_0 / Q8_1
  activations, ``kvserve.cpu.block_dot_kernels``), the LM head included
  (its weight's ``activations`` is ``q8``). Prefill and larger decode
  batches keep ``q4``'s float activations. CPU only.

What stays float for ``int8`` and ``w8a8``: embeddings, norms, biases, and
the LM head. The LM head
is tied to the embedding table in the default model (quantizing it would
quantize the embeddings too), it is the layer whose errors move the
sampled token directly, and it is one step's single largest product only
when the batch is large; ``tools/quality.py`` is the gate for changing that.
For ``q4`` the LM head is the GGUF's own Q8_0 table, because that is what
the model ships as: quantized by its publisher, and measured by the same gate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvserve.model.ggml_blocks import BlockQuantizedWeight, KQuantWeight, StackedWeight

QUANTIZATIONS = ("none", "int8", "w8a8", "q4", "w4a8")
#: Schemes that serve the checkpoint's GGUF blocks (``loader.load_checkpoint_weights``).
BLOCK_SCHEMES = ("q4", "w4a8")
#: Largest magnitude of a symmetric int8 code.
INT8_MAX = 127


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's quantized weight: ``W ~ qweight * scales[:, None]``.

    ``qweight``: int8[out, in]; ``scales``: float32[out] (backend arrays);
    ``scheme``: ``int8`` (float activations) or ``w8a8`` (int8 activations,
    quantized per token at run time).
    """

    qweight: Any
    scales: Any
    scheme: str

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``, as the dense weight's."""
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of ``qweight`` and ``scales``."""
        return int(self.qweight.nbytes + self.scales.nbytes)


#: What ``Ops.linear`` accepts as its weight: a dense [out, in] array, a
#: QuantizedWeight or a BlockQuantizedWeight.
LinearWeight = Any


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8 of float[out, in] ``w``.

    Returns ``(qweight int8[out, in], scales float32[out])``. A row of zeros
    gets scale 1 (and codes 0). Raises ``ValueError`` for a non-2-D or
    non-finite ``w``.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_int8: w must be 2-D [out, in], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_int8: w has non-finite values")
    absmax = np.abs(w).max(axis=1)
    scales = np.where(absmax > 0, absmax / INT8_MAX, 1.0).astype(np.float32)
    qweight = np.clip(np.rint(w / scales[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return qweight, scales


def dequantize_int8(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32[out, in] = ``qweight * scales[:, None]``."""
    return qweight.astype(np.float32) * np.asarray(scales, dtype=np.float32)[:, None]


def quantize_weight(w: np.ndarray | BlockQuantizedWeight, scheme: str, to_device) -> LinearWeight:
    """``w`` as the layer weight of ``scheme`` on the backend (``to_device``:
    host array -> backend array).

    ``w`` is a float[out, in] array, or for ``q4`` possibly a host
    ``BlockQuantizedWeight`` (moved as it is). ``none``, and ``q4`` for a
    tensor the GGUF stores in float, keep it dense. A ``KQuantWeight`` (CPU
    panels, Q8_K activations whatever the scheme) is kept as it is, and a
    ``StackedWeight``'s parts each go through this function. Raises
    ``ValueError`` for an unknown scheme."""
    if isinstance(w, KQuantWeight):
        return w
    if isinstance(w, StackedWeight):
        return StackedWeight(tuple(quantize_weight(p, scheme, to_device) for p in w.parts))
    if isinstance(w, BlockQuantizedWeight):
        moved = w.map(lambda a: _to_device_exact(a, to_device))
        return replace(moved, activations="q8") if scheme == "w4a8" else moved
    if scheme in ("none", *BLOCK_SCHEMES):
        return to_device(w)
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {scheme!r}")
    qweight, scales = quantize_int8(w)
    return QuantizedWeight(to_device(qweight), _to_device_exact(scales, to_device), scheme)


def _to_device_exact(a: np.ndarray, to_device):
    """``to_device(a)`` keeping a float32 array float32: through an int32 view,
    as to_device keeps integer dtypes but casts floats to the backend's dtype."""
    if a.dtype == np.float32:
        return to_device(a.view(np.int32)).view(np.float32)
    return to_device(a)


def weight_nbytes(weight: LinearWeight) -> int:
    """Bytes a layer weight takes on the backend."""
    return int(weight.nbytes)
