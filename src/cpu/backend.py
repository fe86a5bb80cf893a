"""The CPU backend: NumPy/BLAS and Numba kernels in float32 (``kvserve.cpu.ops``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import structlog

from kvserve.config import EngineConfig, ModelConfig
from kvserve.cpu.ops import CpuOps
from kvserve.cpu.threads import (LoadAdaptiveThreads, apply_thread_policy, busy_warning,
                                 resolve_num_threads)

log = structlog.get_logger("kvserve.engine")


class CpuBackend:
    """Float32 on the host; the KV cache gets ``--kv-cache-memory`` bytes.

    Building it applies the thread policy (``--num-threads`` for both BLAS
    and Numba, logged as ``thread_policy``; a ``cpu_busy`` warning when the
    machine is already loaded).
    """

    name = "cpu"
    dtype = np.dtype(np.float32)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        policy = apply_thread_policy(resolve_num_threads(config.num_threads))
        log.info("thread_policy", message=f"CPU threads: {policy.num_threads} for BLAS and "
                 f"Numba ({policy.available_cpus} CPUs available)", **policy.log_fields())
        warning = busy_warning(policy)
        if warning is not None:
            log.warning("cpu_busy", message=warning, num_threads=policy.num_threads)
        # --num-threads pins the count; by default it follows the machine's load
        adaptive = None if config.num_threads is not None else LoadAdaptiveThreads(
            policy.num_threads, policy.available_cpus)
        self.ops = CpuOps(num_threads=policy.num_threads, adaptive=adaptive,
                          batch_invariant=config.batch_invariant)

    def kv_cache_bytes(self, model: ModelConfig, weights_bytes: int, profile: Any = None) -> int:
        """``--kv-cache-memory`` (bytes): host memory is not measured."""
        return self.config.cache.kv_cache_memory

    def warmup(self) -> None:
        """Compile the Numba kernels (``CpuOps.warmup``), the KV ops for the
        configured ``--kv-cache-dtype``."""
        self.ops.warmup(self.config.cache.kv_cache_dtype)
