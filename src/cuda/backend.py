"""The CUDA backend: Numba CUDA kernels on CuPy buffers (``kvserve.cuda.ops``).

On a GPU, weights and KV cache are float16 by default (``--dtype``; bf16
checkpoints are converted to float16) and the KV cache gets what
``--gpu-memory-utilization`` leaves after the weights and a profiling
forward pass at the largest step (vLLM's rule). Under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``: tests, machines without a GPU) the same kernels
run on NumPy arrays, in float32 unless ``--dtype`` says otherwise, and the
KV cache gets ``--kv-cache-memory`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import structlog

from kvserve.config import EngineConfig, ModelConfig
from kvserve.model.backend import BackendUnavailable, cuda_device_present

log = structlog.get_logger("kvserve.engine")

_DTYPES = {"float16": np.float16, "float32": np.float32}


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba import config as numba_config

    return bool(numba_config.ENABLE_CUDASIM)


def check_available() -> None:
    """Raise ``BackendUnavailable`` (one line) unless a CUDA device or the
    simulator can run the kernels."""
    if simulator_enabled() or cuda_device_present():
        return
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise BackendUnavailable(
            "--backend cuda needs CuPy and a CUDA device: CuPy is not installed "
            "(pip install 'kvserve[cuda]'), or use --backend cpu") from None
    raise BackendUnavailable("--backend cuda needs a CUDA device and CuPy found none; "
                             "use --backend cpu")


class CudaBackend:
    """Float16 (or float32) kernels on the device.

    Raises ``BackendUnavailable`` when there is neither a device nor the
    simulator, and ``ValueError`` for a dtype other than float16/float32 or
    for ``--quantization q4`` (no CUDA kernels for GGUF blocks yet).
    """

    name = "cuda"

    def __init__(self, config: EngineConfig) -> None:
        check_available()
        from kvserve.cuda.ops import CudaOps

        if config.quantization == "q4":
            raise ValueError("--quantization q4 (GGUF blocks) runs on the cpu backend only; "
                             "on cuda use int8 or w8a8")
        self.config = config
        self.simulated = simulator_enabled()
        default = "float32" if self.simulated else "float16"
        name = default if config.dtype == "auto" else config.dtype
        if name not in _DTYPES:
            raise ValueError(f"the cuda backend runs float16 or float32, not {name}")
        self.dtype = np.dtype(_DTYPES[name])
        self.ops = CudaOps(dtype=self.dtype)
        log.info("cuda_backend", message=f"CUDA backend: {name}"
                 + (" on Numba's CUDA simulator (no GPU)" if self.simulated else ""),
                 dtype=name, simulated=self.simulated, **_device_fields(self.simulated))

    def kv_cache_bytes(self, model: ModelConfig, weights_bytes: int,
                       profile: Callable[[], None] | None = None) -> int:
        """GPU: ``total x --gpu-memory-utilization`` minus what is in use
        after the weights and a profiling forward pass (its activations stay
        in CuPy's pool for the steps to reuse). Simulator: the profiling pass
        runs too (so it is tested), then ``--kv-cache-memory``. Raises
        ``ValueError`` when nothing is left."""
        if profile is not None:
            profile()
        if self.simulated:
            return self.config.cache.kv_cache_memory
        import cupy

        cupy.cuda.Device().synchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        budget = int(total * self.config.cache.gpu_memory_utilization) - (total - free)
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {total - free:,} of {total:,} bytes are "
                f"in use after loading the weights ({weights_bytes:,} bytes) and profiling; "
                f"raise --gpu-memory-utilization "
                f"({self.config.cache.gpu_memory_utilization}) or use a smaller model")
        return budget

    def warmup(self) -> None:
        """Compile every kernel once (``CudaOps.warmup``)."""
        self.ops.warmup()


def _device_fields(simulated: bool) -> dict:
    """The device's name and memory for the start-up log (nothing when simulated)."""
    if simulated:
        return {}
    import cupy

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    free, total = cupy.cuda.runtime.memGetInfo()
    return {"device": props["name"].decode(), "device_memory_bytes": total,
            "device_free_bytes": free}
