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

import importlib.util
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


def cupy_installed() -> bool:
    """True when a ``cupy`` package is installed (found, not imported)."""
    return importlib.util.find_spec("cupy") is not None


def check_available() -> None:
    """Raise ``BackendUnavailable`` (one line) unless the simulator is on or
    the start-up probe (``kvserve.cuda.probe.probe_cuda``: import, device,
    kernel, cuBLAS matmul, read-back) passes on this machine."""
    if simulator_enabled():
        return
    from kvserve.cuda.probe import probe_cuda

    result = probe_cuda()
    if not result.ok:
        raise BackendUnavailable(f"--backend cuda needs a working CUDA stack; the start-up "
                                 f"probe failed at {result.step}: {result.reason}; "
                                 f"or use --backend cpu")


def auto_picks_cuda() -> bool:
    """``--backend auto``'s choice: True when the start-up probe passes.

    Without CuPy installed: False at once, nothing CUDA imported (a CPU
    machine). Under Numba's CUDA simulator: no probe, True when CuPy sees a
    device (the simulator is a test mode). A failed probe: False, with one
    warning line ``cuda_probe_failed`` carrying the step and reason.
    """
    if not cupy_installed():
        return False
    if simulator_enabled():
        return cuda_device_present()
    from kvserve.cuda.probe import probe_cuda

    result = probe_cuda()
    if not result.ok:
        log.warning("cuda_probe_failed", step=result.step, reason=result.reason,
                    message=f"--backend auto: CUDA is installed but unusable, serving on the "
                            f"CPU; the probe failed at {result.step}: {result.reason}")
    return result.ok


class CudaBackend:
    """Float16 (or float32) kernels on the device.

    Raises ``BackendUnavailable`` when the start-up probe fails (and the
    simulator is off), and ``ValueError`` for a dtype other than float16/float32.
    """

    name = "cuda"

    def __init__(self, config: EngineConfig) -> None:
        check_available()
        from kvserve.cuda.ops import CudaOps

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
        """Compile every kernel once (``CudaOps.warmup``), those of the int8
        KV cache too under ``--kv-cache-dtype int8``."""
        self.ops.warmup(kv_cache_dtype=self.config.cache.kv_cache_dtype)


def capture_graphs(backend: CudaBackend, model, kv_caches, max_num_seqs: int,
                   max_model_len: int):
    """The decode step's CUDA graphs (``kvserve.cuda.graphs.DecodeGraphs``)
    for ``model`` over ``kv_caches``, or None (logged as ``cuda_graphs``
    with the reason): with ``--enforce-eager``, under the simulator
    (nothing to capture), or when capturing fails (then the engine runs
    eagerly, with a warning)."""
    from kvserve.cuda.graphs import DecodeGraphs, decode_run
    from kvserve.model.ops import StepGeometry

    reason = ("--enforce-eager" if backend.config.enforce_eager
              else "Numba's CUDA simulator has no graphs" if backend.simulated else None)
    if reason is not None:
        log.info("cuda_graphs", captured=False, reason=reason,
                 message=f"CUDA graphs not captured ({reason}): decode steps run eagerly")
        return None
    cache = kv_caches[0]
    geometry = StepGeometry(model.config.vocab_size, int(model.rope_cache.shape[0]),
                            int(cache.shape[0]), int(cache.shape[2]))
    try:
        layout = getattr(model, "kv_layout", None)
        graphs = DecodeGraphs(backend.ops, decode_run(model, kv_caches), geometry,
                              max_num_seqs, max_model_len,
                              num_groups=layout.num_groups if layout is not None else 1)
    except Exception as exc:  # noqa: BLE001 - eager still works: say why, go on
        log.warning("cuda_graphs", captured=False, reason=f"{type(exc).__name__}: {exc}",
                    message=f"CUDA graph capture failed ({type(exc).__name__}: {exc}); "
                            "decode steps run eagerly")
        return None
    graphs.log()
    return graphs


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
