"""The HTTP layer: the FastAPI app and everything around the routes.

* ``app.py``: ``build_app``: the routes only, the work in :mod:`server.api`;
* ``pooling_routes.py``: the classifier routes (score, rerank, classify) and their aliases;
* ``lora_routes.py``: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (opt-in);
* ``respond.py``: a body parsed (400 naming the field), then JSON or SSE within the deadline,
  aborted when the client leaves, the load-shedding ticket released;
* ``middleware.py``: the front door: request id, API key, body-size limit, draining, metrics;
* ``request_context.py``: the current request's id for headers and logs; POSTs in flight;
* ``errors.py``: one OpenAI-style error type and body, handlers for everything else;
* ``openapi.py``: request bodies in ``/openapi.json`` for routes that parse their own body;
* ``offload.py``: ``Offload``: the threads a request is prepared in (tokenizing, templates), off
  the event loop;
* ``limits.py``: load shedding (429 + ``Retry-After``) and deadlines (504) of the work routes;
* ``metrics.py``: ``Metrics``: the Prometheus metrics of ``GET /metrics``, ``shardserve_*``;
* ``lifecycle.py``: the draining state of a graceful shutdown, and requests in flight;
* ``draining.py``: uvicorn that drains on the first SIGINT/SIGTERM;
* ``ttft_trace.py``: opt-in time-to-first-token tracing (``SHARDSERVE_TTFT_TRACE=file``): its
  outermost middleware, the ``span``/``first`` decorators and the engine client's wire seams.

``build_app`` is a factory with no module globals (each app its own metrics registry), so
several apps can live in one process. Every error, whatever raised it, leaves with the OpenAI
body; a validation error is a 400 naming the field, never FastAPI's 422.
"""
