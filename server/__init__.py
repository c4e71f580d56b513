"""The frontend: one process serving the OpenAI-compatible HTTP API in front of the replicas.

* ``http/``: the FastAPI app, the front door, load shedding, metrics, errors, draining;
* ``api/``: one module per route family; request bodies, choices, structured outputs, tools;
* ``text/``: tokenizer, chat templates, incremental detokenizer, stop strings, tool parsers;
* ``media/``: images and videos in chat messages: fetch, decode, preprocess, placeholders;
* ``engine/``: the replicas seen as one engine: ZMQ clients, batcher, router, supervisor;
* ``cli/``: the ``shardserve`` command (``serve``, ``engine``, ``ping``, ``bench``).

No torch (tests/server/test_imports.py): the frontend talks to each replica's rank 0 only in
:mod:`model_shards.messages` over ZMQ, and reads checkpoints through the torch-free
:mod:`model_shards.config`; :mod:`model_shards.launch` is imported only to start replicas.
Text and media work (templates, tokenizing, detokenizing, stop strings, image and video
preprocessing) happens here: the engine gets token ids and pixels.
"""
