"""Data-parallel serving on Ray: engine replicas as Ray actors, and the
client the API process uses to route requests to them.

``replica`` is the actor (one engine, its own process, KV cache and worker);
``client`` starts the replicas and implements the API's ``EngineClient``
over them, routing each request with ``kvserve.core.router``.

Ray comes with the ``distributed`` extra (``pip install 'kvserve[distributed]'``)
and is imported only when replicas start (``DataParallelClient.start``);
``host_tier`` and ``kv_connector``, which every engine uses, need no Ray.
"""
