"""kvserve: a diagnosable LLM inference serving engine.

See DESIGN.md (shared) for the map: actors pass typed messages over asyncio
queues; the pure scheduling and KV-cache logic lives in ``kvserve.core``.
"""

__version__ = "0.1.0"
