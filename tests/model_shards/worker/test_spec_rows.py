"""The accept/resample rule of a verify step, checked statistically on a 6-token vocabulary.

Thousands of seeded sequences each verify one n-gram draft ``d`` (a point mass ``q``) through the
real sampler (:func:`~model_shards.worker.spec_rows.sampled_rows`, then
:func:`~model_shards.engine.speculative.verify.accepted_run`). Chi-square tests (fixed seeds,
so the outcome is fixed) check what the standard rule promises: ``d`` is accepted with
probability ``p(d)``; a rejection emits a token distributed as ``normalize(max(0, p - q))``; the
first emitted token is distributed as ``p``, the one after an accepted draft as the next
position's ``p``. A deliberately wrong rule (on rejection, resample from ``p``) fails the same
test. Each row's sample is the one plain decoding draws at that position with that seed.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest, chisquare

from model_shards.backends import ReferenceBackend
from model_shards.engine.speculative.verify import accepted_run
from model_shards.messages import NewSequence, SamplingParams, SeqChunk
from model_shards.worker.sampler import Sampler
from model_shards.worker.spec_rows import sampled_rows
from tests.model_shards.worker.sampler_cases import OnDeviceReference

N = 3000
DRAFT = 3
# the logits after positions 1 and 2 (the same for every sequence; seeds differ)
LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.0], [0.3, 1.2, 0.0, -0.2, 0.5, 0.1]])
P0, P1 = LOGITS.softmax(-1).double()
ALPHA = 1e-3


def _verify(sampler: Sampler) -> tuple[list[list[int]], list[int]]:
    """Every sequence's emitted tokens, and the samples of its two rows."""
    chunks = [SeqChunk(i, 1, [5, DRAFT], num_draft=1) for i in range(N)]
    rows, views = sampled_rows(chunks)
    assert rows == list(range(2 * N))  # each chunk's two rows, in order
    samples = sampler.sample(LOGITS.repeat(N, 1), views).tokens.tolist()
    return [accepted_run([DRAFT], samples[2 * i : 2 * i + 2]) for i in range(N)], samples


def _sampler(backend: ReferenceBackend) -> Sampler:
    sampler = Sampler(backend)
    for i in range(N):
        sampler.add(NewSequence(i, SamplingParams(1.0, seed=7919 * i + 1), 2))
    return sampler


def _fits(tokens: list[int], p: torch.Tensor, support: list[int]) -> float:
    """Chi-square p-value of ``tokens`` against ``p`` restricted to ``support``."""
    q = p[support] / p[support].sum()
    counts = [tokens.count(t) for t in support]
    return float(chisquare(counts, (q * len(tokens)).tolist()).pvalue)


@pytest.mark.parametrize("backend", [ReferenceBackend, OnDeviceReference])
def test_accept_resample_rule_is_the_targets_distribution(backend: type[ReferenceBackend]) -> None:
    emitted, samples = _verify(_sampler(backend()))
    everything = list(range(6))
    accepted = [e for e in emitted if len(e) == 2]
    rejected = [e[0] for e in emitted if len(e) == 1]
    assert binomtest(len(accepted), N, float(P0[DRAFT])).pvalue > ALPHA
    assert _fits([e[0] for e in emitted], P0, everything) > ALPHA
    others = [t for t in everything if t != DRAFT]
    assert DRAFT not in rejected and _fits(rejected, P0, others) > ALPHA  # normalize(p - q)
    assert _fits([e[1] for e in accepted], P1, everything) > ALPHA
    # reproducible, and each row is the sample plain decoding draws there
    assert _verify(_sampler(backend()))[1] == samples
    plain = _sampler(backend()).sample(
        LOGITS[:1].repeat(N, 1), [SeqChunk(i, 1, [5]) for i in range(N)]
    )
    assert plain.tokens.tolist() == samples[::2]


def test_a_wrong_rule_fails_the_same_test() -> None:
    """On rejection resample from ``p`` itself (``d`` included): ``d`` comes out too often."""
    emitted, _ = _verify(_sampler(ReferenceBackend()))
    gen = torch.Generator().manual_seed(0)
    wrong = [
        e[0] if len(e) == 2 else int(torch.multinomial(P0.float(), 1, generator=gen))
        for e in emitted
    ]
    assert _fits(wrong, P0, list(range(6))) < ALPHA
