"""Numba ``@cuda.jit`` kernels of the CUDA backend: one import point for
the kernel families, and what every kernel assumes.

One kernel per job; :class:`kvserve.cuda.ops.CudaOps` checks every argument
(shapes, dtypes, contiguity, index ranges) and chooses the launch
configuration, so the kernels trust their inputs: a kernel cannot raise on a
GPU, and an index out of range would corrupt memory silently.

Dtypes: activations, weights and the KV cache are float32 or float16; every
kernel converts to float32 on load, accumulates in float32 and rounds once on
store.  bfloat16 is not a kernel dtype: the backend converts bf16 checkpoints
to float16 when it loads them (``CudaOps.to_device``).  The KV cache may
also be int8 (``--kv-cache-dtype int8``: codes and a float32 scale per
vector, ``kvserve.model.kv_quant``), which the ``*_int8_kernel``s write and
read; each attention kernel is written once for both caches (see the
int8 section of :mod:`kvserve.cuda.decode_kernels`), and the float kernels
compute what they did without it.

Launch mappings are 1-D blocks of any size up to :data:`MAX_BLOCK_THREADS`
(the matmuls, in :mod:`kvserve.cuda.gemv_kernels`, are 2-D): loops stride
over the work by ``blockDim``, so the same kernel runs with a warp-multiple
block on a GPU and with a handful of threads under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), where each CUDA thread is a Python thread and
the tests run.  The mappings are the
readable baseline (scalar float32 FMAs, no tensor cores, no vectorized loads);
each kernel's docstring states its grid, block and barriers.

KV cache and attention metadata follow vLLM's paged layout
(``kvserve.model.ops``): ``kv_cache[num_blocks, 2, block_size, nkv, hd]``
(axis 1: 0 = K, 1 = V), token position ``j`` of sequence ``s`` lives in block
``block_tables[s, j // block_size]`` at offset ``j % block_size``.

Sliding-window attention (Gemma 3's local layers; Beltagy et al. 2020,
Mistral's ``sliding_window``): every attention kernel takes ``window``, 0
for full causal attention, else a query at position p attends to keys
p - window < j <= p only.  The kernels start their loops at the window's
first key (``kernel_base._window_start``): a key before it is never loaded, not
loaded and masked, since the KV manager frees the blocks behind the window
and they may hold another request's K/V (or NaN).

The families (each module holds the device helpers its kernels call: see
:mod:`kvserve.cuda.kernel_base` for why):

- :mod:`kvserve.cuda.kernel_base`: shared limits and scalar helpers;
- :mod:`kvserve.cuda.row_kernels`: embedding, RMSNorm, RoPE, SiLU / GELU,
  W8A8 activation quantization;
- :mod:`kvserve.cuda.decode_kernels`: KV writes (float and int8), split-K
  decode attention and its reduction, the fused decode kernel;
- :mod:`kvserve.cuda.prefill_kernels`: prefill attention;
- :mod:`kvserve.cuda.gemv_kernels` (imported on its own): the int8, W8A8
  and ggml-block matmuls.

``CudaOps`` and the tests reach the kernels here (``kernels.rms_norm_kernel``);
the launch-signature manifest (``tests/cuda/launch_signatures.py``) names
them by this module too.
"""

from __future__ import annotations

from kvserve.cuda.decode_kernels import (MAX_GROUP, decode_fused_int8_kernel,
                                         decode_fused_kernel, decode_partition_int8_kernel,
                                         decode_partition_kernel, decode_reduce_kernel,
                                         write_kv_int8_kernel, write_kv_kernel)
from kvserve.cuda.kernel_base import (GEMV_MAX_ROWS, INT8_MAX, MATMUL_TILE, MAX_BLOCK_THREADS,
                                      MAX_HEAD_DIM, MAX_PARTITION_SIZE, PREFILL_KV_TILE,
                                      W8A8_GROUP)
from kvserve.cuda.prefill_kernels import prefill_attention_int8_kernel, prefill_attention_kernel
from kvserve.cuda.row_kernels import (embedding_kernel, fused_add_rms_norm_kernel,
                                      fused_norm_add_rms_norm_kernel, gelu_tanh_and_mul_kernel,
                                      quantize_groups_kernel, rms_norm_kernel, rotary_kernel,
                                      silu_and_mul_kernel)

__all__ = [
    "GEMV_MAX_ROWS", "INT8_MAX", "MATMUL_TILE", "MAX_BLOCK_THREADS", "MAX_GROUP", "MAX_HEAD_DIM",
    "MAX_PARTITION_SIZE", "PREFILL_KV_TILE", "W8A8_GROUP",
    "embedding_kernel", "rms_norm_kernel", "fused_add_rms_norm_kernel",
    "fused_norm_add_rms_norm_kernel", "rotary_kernel", "silu_and_mul_kernel",
    "gelu_tanh_and_mul_kernel", "quantize_groups_kernel",
    "write_kv_kernel", "write_kv_int8_kernel", "decode_partition_kernel",
    "decode_partition_int8_kernel", "decode_reduce_kernel", "decode_fused_kernel",
    "decode_fused_int8_kernel",
    "prefill_attention_kernel", "prefill_attention_int8_kernel",
]
