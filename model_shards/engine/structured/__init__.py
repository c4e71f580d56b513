"""Structured outputs on the engine side: grammar-constrained decoding with ``xgrammar``.

* ``grammars.py`` (rank 0): ``GrammarCache``: one compile per distinct ``GrammarSpec`` (an LRU),
  loaded into rank 0 from the compile workers, never on the step loop;
* ``compile_pool.py`` (rank 0): ``CompilePool``: compile worker processes, each job with a
  deadline (``--grammar-compile-timeout``); a worker past it is killed and replaced;
* ``compile_worker.py`` (its own process): one compile worker, ``python -m`` it;
* ``constraints.py`` (rank 0): requests waiting for their grammar, per-sequence matchers, each
  sequence's next mask computed ahead (held out of steps until ready, ended if too slow);
* ``mask_pool.py`` (rank 0): the daemon threads masks are filled in, each job with a deadline;
* ``bitmask.py`` (the sampling rank; torch only): token bitmasks and one step's logit
  adjustments (``logit_bias``, allowed tokens, grammar masks).

A request waits here, unseen by the scheduler, until its grammar is compiled and its first mask
filled, so a slow compile or grammar delays nobody else. ``xgrammar`` is imported only on rank 0
and its compile workers, and only once a constrained request arrives; the frontend checked each
spec already (:mod:`server.api.structured`).
"""
