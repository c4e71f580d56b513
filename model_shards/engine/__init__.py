"""Rank 0's engine: requests in over ZMQ, a scheduling decision per step, plans out, tokens back.

* ``coordinator.py``: ``Coordinator``: schedule, broadcast the plan, run rank 0's stage, update;
* ``in_flight.py``: the steps launched and not yet applied; whether async scheduling runs;
* ``zmq_loop.py``: rank 0's ROUTER loop (Hello, submits, aborts, keep-alives), for both engines;
* ``replies.py``: a step's outputs grouped per frontend, with the engine's counters attached;
* ``engine_port.py``: the port's guard: frames decoded safely, the engine token checked;
* ``request_checks.py``: every reason the engine refuses a generation request, in one place;
* ``scheduler/``: continuous batching over the paged, prefix-cached KV pool (pure Python);
* ``structured/``: grammar-constrained decoding: compiles, matchers, each step's token masks;
* ``speculative/``: speculative decoding: n-gram proposals, a draft model's (tp=1, on rank 0),
  the acceptance gate, the accept rule;
* ``request_trace.py``: a traced request's TTFT stamps on rank 0 (opt-in);
* ``prompt_logprobs.py``: which prompt rows each chunk scores; the scores into first outputs;
* ``embedding_coordinator.py``: an encoder replica's engine: batch inputs, embed or score, reply;
* ``dp_attention.py``: ``--dp-attention``: replicas stepping in lockstep around their MoE layers.

Rank 0 only (under ``--dp-attention`` every rank is the rank 0 of its own replica): every
scheduling decision is made here and reaches the other ranks in a ``StepPlan``; with pp > 1 up
to pp steps are in flight, with async scheduling (pp = 1) two: the next planned while one runs.
The one part another rank runs is ``structured/bitmask.py``, which the sampling rank applies to
its logits.
"""
