"""The Backend interface: everything that differs per device, in one object.

A backend bundles the ops the model runs on (``kvserve.model.ops.Ops``), the
dtype of weights, activations and KV cache, array transfer, the memory
planner (how many bytes the KV cache may take) and a warm-up. The engine
builds the model, runner and KV cache through it, on the worker thread that
will run them (CuPy's current device and stream are per thread).

Backends: ``cpu`` (``kvserve.cpu.backend``: NumPy/BLAS and Numba kernels,
float32) and ``cuda`` (``kvserve.cuda.backend``: Numba CUDA kernels on CuPy
buffers, float16 by default; under Numba's CUDA simulator, for tests, the
same kernels on NumPy arrays). ``auto`` picks ``cuda`` when the start-up
probe (``kvserve.cuda.probe``: a Numba kernel and a cuBLAS matmul run and
read back) passes, else ``cpu`` (vLLM's device auto-detection, made to
tell the truth); nothing CUDA is imported where CuPy is not installed.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvserve.config import EngineConfig, ModelConfig
from kvserve.model.ops import Ops

BACKENDS = ("auto", "cpu", "cuda")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine (the message says why
    in one line, for the CLI to print without a traceback)."""


@runtime_checkable
class Backend(Protocol):
    """What the engine needs from a device."""

    name: str
    """``"cpu"`` or ``"cuda"``."""

    ops: Ops
    """The kernels the model runs on."""

    dtype: np.dtype
    """Dtype of weights, activations and the KV cache on the device."""

    def kv_cache_bytes(self, model: ModelConfig, weights_bytes: int,
                       profile: Any = None) -> int:
        """Bytes the KV cache may take, after the weights are on the device.

        ``profile``: a callable that runs one forward pass at the largest
        step the scheduler may build (a GPU backend measures its activation
        peak with it). Raises ``ValueError`` when nothing is left.
        """
        ...

    def warmup(self) -> None:
        """Compile every kernel once, so the first request does not pay it."""
        ...


def cuda_device_present() -> bool:
    """True when CuPy imports and sees at least one CUDA device (under Numba's
    CUDA simulator too). A cheap look that proves nothing about compiling
    kernels or cuBLAS: ``kvserve.cuda.probe.probe_cuda`` does."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device: no CUDA
        return False


def resolve_backend(name: str) -> str:
    """``auto`` -> ``cuda`` when the CUDA start-up probe passes, else ``cpu``
    (``kvserve.cuda.backend.auto_picks_cuda``: a warning line when CUDA is
    installed but fails); ``cpu``/``cuda`` as given (``create_backend``
    checks ``cuda``). Raises ``ValueError`` for another name."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        from kvserve.cuda.backend import auto_picks_cuda

        return "cuda" if auto_picks_cuda() else "cpu"
    return name


def create_backend(config: EngineConfig) -> Backend:
    """The backend ``config.backend`` names (``auto`` resolved).

    Raises ``BackendUnavailable`` when it cannot run here (``cuda`` whose
    start-up probe fails, and not under the simulator).
    """
    name = resolve_backend(config.backend)
    if name == "cpu":
        from kvserve.cpu.backend import CpuBackend

        return CpuBackend(config)
    from kvserve.cuda.backend import CudaBackend

    return CudaBackend(config)
