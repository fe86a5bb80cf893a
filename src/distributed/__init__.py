"""Data-parallel serving on Ray: engine replicas as Ray actors, and the
client the API process uses to route requests to them.

``replica`` is the actor (one engine, its own process, KV cache and worker);
``client`` starts the replicas and implements the API's ``EngineClient``
over them, routing each request with ``kvserve.core.router``.
"""
