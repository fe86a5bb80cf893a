"""kvserve: a diagnosable LLM inference serving engine.

See DESIGN.md (shared) for the map: actors pass typed messages over asyncio
queues; the pure scheduling and KV-cache logic lives in ``kvserve.core``.

Importing kvserve changes nothing in the process's environment: the thread
pools' variables (``OPENBLAS_THREAD_TIMEOUT``, ``GOMP_SPINCOUNT``) are set by
the ``kvserve`` command before NumPy loads (``kvserve.thread_env``).
"""

__version__ = "0.1.0"
