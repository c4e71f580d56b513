"""Structured outputs on the engine side: grammar-constrained decoding with ``xgrammar``.

* ``grammars.py`` (rank 0): ``GrammarCache``: one compile per distinct ``GrammarSpec`` (an LRU),
  in a background thread, never on the step loop;
* ``constraints.py`` (rank 0): requests waiting for their grammar, per-sequence matchers advanced
  with the sampled tokens, each step's token masks for the plan;
* ``bitmask.py`` (the sampling rank; torch only): token bitmasks and one step's logit
  adjustments (``logit_bias``, allowed tokens, grammar masks).

A request waits here, unseen by the scheduler, until its grammar is compiled, so a slow compile
delays nobody else. ``xgrammar`` is imported only on rank 0, and only once a constrained request
arrives; the frontend checked each spec already (:mod:`server.api.structured`).
"""
