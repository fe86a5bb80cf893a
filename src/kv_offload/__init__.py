"""The KV cache's offload tiers on one node and the worker's connector to
them: a shared-memory host tier (``host_tier``), a disk tier below it
(``disk_tier``), and the ``KVConnector`` that saves, loads, exports and
imports blocks for the runner (``kv_connector``).

KV memory, not scale-out: the model runner and the worker use it on a
single node; ``kvserve.distributed`` (replicas, pipeline and tensor
parallelism) builds on it, never the other way round.
"""
