"""Speculative decoding on rank 0: proposals before a step, the accept rule after it.

* ``ngram.py``: prompt lookup: the tokens that followed the latest earlier occurrence of the
  sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``);
* ``proposer.py``: a sequence's proposer state: its n-gram index (or the drafts a draft model
  offered it this step), how many drafts it may take (the step's budget, ``max_tokens``, the
  model length), and the acceptance gate that pauses proposals while too few are accepted to
  pay for their verification; ``BatchProposer``, what a draft model offers the scheduler;
* ``draft_model.py``: a draft model (``--speculative-config`` ``model``) at tp=1 in rank 0's
  process, its own worker and small paged pool, proposing its greedy tokens for every
  speculating sequence of a step in one batch (``K`` draft forwards);
* ``verify.py``: the accept rule over the target's samples at the draft positions, and the
  counters (vLLM's ``spec_decode`` metrics).

A sequence with ``K`` drafts runs one chunk of ``K + 1`` tokens (its last token and the drafts);
each row attends as a decode row would (``layers/attention.py``: the decode kernel, the
sequence's K/V up to that row), the last stage samples after each of them exactly as it would
one at a time (same seed, same position: :mod:`model_shards.worker.spec_rows`), and the drafts
are accepted while they equal the samples, then the first differing sample (or the sample
after the last draft) is emitted: the tokens of plain decoding (up to how a GEMM over more
rows rounds its last bits: the quantized CPU kernels of the packaged SmolLM2 do not differ).
A draft model proposes its argmax tokens: a point mass, for which this accept rule is the exact
rejection rule (``q(x) = 1``), so sampled output keeps the target's distribution too.
"""
