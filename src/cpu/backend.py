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
        """``--kv-cache-memory`` (bytes), as asked. The cache's pages are
        committed as requests fill them, so a cache larger than the memory
        left would start and then be killed under load: when it exceeds
        ``available_memory_bytes`` (the weights are loaded by now), log
        ``kv_cache_exceeds_memory`` naming both figures and the flag."""
        kv_bytes = self.config.cache.kv_cache_memory
        available = available_memory_bytes()
        if available is not None and kv_bytes > available:
            log.warning("kv_cache_exceeds_memory", kv_cache_bytes=kv_bytes,
                        available_bytes=available, weights_bytes=weights_bytes,
                        message=f"The KV cache ({kv_bytes / 2**30:.2f} GiB) is larger than the "
                                f"memory left after the weights ({available / 2**30:.2f} GiB "
                                "available): the server would be killed for memory once requests "
                                "fill it; lower --kv-cache-memory")
        return kv_bytes

    def warmup(self) -> None:
        """Compile the Numba kernels (``CpuOps.warmup``), the KV ops for the
        configured ``--kv-cache-dtype``."""
        self.ops.warmup(self.config.cache.kv_cache_dtype)


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to new allocations without
    swapping (``MemAvailable`` of ``meminfo``, bytes); None where there is no
    such file (not Linux) or line."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
