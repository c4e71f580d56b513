"""The OpenAI-compatible routes' work: request bodies, checks, choices, and their answers.

* ``protocol.py``: what every route shares: sampling fields, usage, models, unsupported fields;
* ``completion_protocol.py``: ``POST /v1/completions`` request and response bodies;
* ``chat_protocol.py``: ``POST /v1/chat/completions`` request and response bodies;
* ``serving.py``: the served model, the checks only the frontend makes, engine errors, SSE;
* ``choices.py``: one request fanned out into its choices (a seed each), run together;
* ``completions.py``: ``/v1/completions``: checks that need the engine, then JSON or SSE;
* ``chat.py``: ``/v1/chat/completions``: template the messages, then JSON or SSE;
* ``chat_tools.py``: ``tool_choice`` to a plan (a grammar when forced), output to ``tool_calls``;
* ``structured.py``: ``response_format``, ``structured_outputs``, ``guided_*`` to one grammar;
* ``logprobs.py``: the engine's per-token logprobs in both OpenAI shapes;
* ``embeddings.py``: ``POST /v1/embeddings`` for encoder replicas;
* ``pooling_protocol.py``: ``/v1/score``, ``/v1/rerank``, ``/classify`` bodies (vLLM's shapes);
* ``scoring.py``: score, rerank and classify on a cross-encoder: text pairs, checks, answers.
* ``responses_protocol.py``: ``POST /v1/responses`` request body (input items, tools, text);
* ``responses.py``: ``/v1/responses``: input items as a chat request, planned and run as chat;
* ``responses_output.py``: the ``response`` object, its output items and their stream events;
* ``responses_stream.py``: ``/v1/responses`` with ``stream``: the spec's SSE events;
* ``responses_store.py``: the bounded LRU store behind ``previous_response_id``, GET, DELETE.
* ``batch.py``: OpenAI's batch file format: input lines to requests on the app, output records.
* ``lora.py``: ``LoraRegistry``: the LoRA adapters a request may name; runtime load and unload.

Bodies are validated by pydantic and nowhere else; what needs the engine's numbers (vocabulary,
context length) the route modules check, each a 400 naming the field. Each route module
prepares first and generates second, so the app can shed load and set a deadline in between.
The engine checks every request again (:mod:`model_shards.engine.request_checks`).
"""
