"""Structured outputs on the engine side: grammar-constrained decoding with ``xgrammar``.

* :mod:`.bitmask` (torch only, every sampling rank): token bitmasks ↔ boolean masks, and
  the logit adjustments (``logit_bias``, allowed tokens, grammar masks) of one step;
* :mod:`.grammars` (rank 0): the grammar compiler, one compile per distinct
  :class:`~model_shards.messages.GrammarSpec` (an LRU cache), in a background thread;
* :mod:`.constraints` (rank 0): requests waiting for their grammar, the per-sequence
  matchers advanced with the sampled tokens, and each step's masks for the plan.

``xgrammar`` is imported only on rank 0, and only once a constrained request arrives.
"""
