"""The Backend interface: everything that differs per device, in one object.

A backend bundles the ops the model runs on (``kvserve.model.ops.Ops``), the
dtype of weights, activations and KV cache, array transfer, the memory
planner (how many bytes the KV cache may take) and a warm-up. The engine
builds the model, runner and KV cache through it, on the worker thread that
will run them (CuPy's current device and stream are per thread).

Backends are found by name in a registry (``register_backend``): ``cpu``
(``kvserve.cpu.backend``: NumPy/BLAS and Numba kernels, float32) and
``cuda`` (``kvserve.cuda.backend``: Numba CUDA kernels on CuPy buffers,
float16 by default; under Numba's CUDA simulator, for tests, the same
kernels on NumPy arrays). The registry holds them as lazy references
(``"module:attribute"``) and imports a backend's module only when it is
asked for, so this module imports neither. ``auto`` picks the first
registered backend whose ``auto_check`` passes -- ``cuda`` when its start-up
probe (``kvserve.cuda.probe``: a Numba kernel and a cuBLAS matmul run and
read back) passes -- else ``cpu`` (vLLM's device auto-detection, made to
tell the truth); nothing CUDA is imported where CuPy is not installed.
A third backend registers itself the same way and gets the conformance
suite (``tests/backends``) for free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvserve.config import EngineConfig, ModelConfig
from kvserve.model.ops import Ops

#: The backend ``auto`` falls back to when no registered ``auto_check`` passes.
DEFAULT_BACKEND = "cpu"


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


#: A factory or a check, given as the object or lazily as ``"module:attribute"``.
Ref = str | Callable[..., Any]


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend: ``factory(config) -> Backend`` and, when
    ``--backend auto`` may choose it, ``auto_check() -> bool`` (True: this
    machine can run it). Either may be a ``"module:attribute"`` string,
    imported on first use."""

    name: str
    factory: Ref
    auto_check: Ref | None = None


_REGISTRY: dict[str, BackendEntry] = {}


def register_backend(name: str, factory: Ref, auto_check: Ref | None = None) -> None:
    """Make ``name`` a backend that ``create_backend`` can build.

    ``factory``: ``EngineConfig -> Backend`` (raising ``BackendUnavailable``
    when it cannot run here), or ``"module:attribute"`` naming one, imported
    only when that backend is asked for. ``auto_check``: ``() -> bool`` (or
    its ``"module:attribute"``), consulted by ``resolve_backend("auto")`` in
    registration order; None: ``auto`` never picks it. Registering a name
    again replaces its entry. Raises ``ValueError`` for the name ``auto``.
    """
    if name == "auto" or not name:
        raise ValueError(f"a backend cannot be named {name!r}")
    _REGISTRY[name] = BackendEntry(name, factory, auto_check)


def registered_backends() -> tuple[str, ...]:
    """The registered backends' names, in registration order (``auto`` excluded)."""
    return tuple(_REGISTRY)


def _load(ref: Ref) -> Callable[..., Any]:
    """The callable ``ref`` names (``"module:attribute"`` imported now)."""
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def resolve_backend(name: str) -> str:
    """``auto`` -> the first registered backend whose ``auto_check`` passes
    (``cuda`` when its start-up probe passes:
    ``kvserve.cuda.backend.auto_picks_cuda``, with a warning line when CUDA
    is installed but fails), else ``DEFAULT_BACKEND``; a registered name as
    given (``create_backend`` checks it can run). Raises ``ValueError`` for
    another name."""
    if name != "auto" and name not in _REGISTRY:
        raise ValueError(f"backend must be one of {', '.join(('auto', *_REGISTRY))}, "
                         f"got {name!r}")
    if name != "auto":
        return name
    for entry in _REGISTRY.values():
        if entry.auto_check is not None and _load(entry.auto_check)():
            return entry.name
    return DEFAULT_BACKEND


def create_backend(config: EngineConfig) -> Backend:
    """The backend ``config.backend`` names (``auto`` resolved), built by its
    registered factory.

    Raises ``BackendUnavailable`` when it cannot run here (``cuda`` whose
    start-up probe fails, and not under the simulator), ``ValueError`` for
    an unregistered name.
    """
    return _load(_REGISTRY[resolve_backend(config.backend)].factory)(config)


register_backend("cpu", "kvserve.cpu.backend:CpuBackend")
register_backend("cuda", "kvserve.cuda.backend:CudaBackend",
                 auto_check="kvserve.cuda.backend:auto_picks_cuda")
