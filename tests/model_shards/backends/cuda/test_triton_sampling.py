"""On-device sampling: the Triton exponential race equals the reference race draw for draw,
and :func:`sample_batch` gives the tokens of the per-row :class:`Sampler` on mixed batches
(greedy, temperature, top-k, top-p, min-p, penalties, min_tokens), with either race.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import pytest
import torch

from model_shards.backends.cuda.triton_ops.sampling import exponential_race as triton_race
from model_shards.backends.reference import ReferenceBackend
from model_shards.messages import NewSequence, SamplingParams, SeqChunk
from model_shards.worker import top_p
from model_shards.worker.sampler import Sampler, filter_logits, position_seed
from model_shards.worker.sampling_batch import Race, SamplingTensors, has_penalties, sample_batch

REF = ReferenceBackend()
STOP_IDS = [3, 11]
HISTORY_VOCAB = 24  # histories draw their tokens from 0 .. 23

# one row kind each; the batch cycles through them
KINDS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.4),
    SamplingParams(temperature=0.0, min_tokens=50),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.5, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.3),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, min_p=1.0),  # the tied top tokens only
    SamplingParams(temperature=0.9, top_p=0.0),  # the top token only
    SamplingParams(temperature=0.6, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(
        temperature=1.0,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        top_p=0.95,
    ),
    SamplingParams(temperature=1.1, repetition_penalty=0.7, frequency_penalty=-0.5),
    SamplingParams(temperature=1.0, top_k=100_000, top_p=1.0, min_p=0.0),  # every stage off
    SamplingParams(temperature=1.0, min_tokens=50, top_p=0.9),
    SamplingParams(temperature=1.0, min_tokens=1, presence_penalty=1.0),  # reached (usually)
]


@dataclass
class Batch:
    sampler: Sampler
    chunks: list[SeqChunk]
    tensors: SamplingTensors


def _make_batch(g: torch.Generator, rows: int, vocab: int, seed_base: int) -> Batch:
    """``rows`` sequences fed to a :class:`Sampler` (prompt, some output, one chunk to
    sample each) and the same rows as :class:`SamplingTensors`, built as the engine
    would: position seeds, histories of penalised rows, the stop ids still masked."""
    sampler = Sampler(REF)
    chunks: list[SeqChunk] = []
    params: list[SamplingParams] = []
    seeds: list[int] = []
    histories: list[list[int] | None] = []
    prompt_lens: list[int] = []
    stops: list[list[int]] = []
    for row in range(rows):
        seed = seed_base + row
        p = msgspec.structs.replace(KINDS[row % len(KINDS)], seed=seed)
        n = int(torch.randint(1, 9, (1,), generator=g))  # prompt length
        length = n + int(torch.randint(0, 6, (1,), generator=g))  # and some output
        tokens = torch.randint(0, HISTORY_VOCAB, (length,), generator=g).tolist()  # repeats
        sampler.add(NewSequence(row, p, n, stop_token_ids=STOP_IDS))
        if len(tokens) > 1:
            sampler.observe(SeqChunk(row, 0, tokens[:-1], sample=False))
        chunk = SeqChunk(row, len(tokens) - 1, tokens[-1:])
        sampler.observe(chunk)
        chunks.append(chunk)
        position = len(tokens)
        params.append(p)
        seeds.append(position_seed(seed, position) if p.temperature > 0 else 0)
        histories.append(tokens if has_penalties(p) else None)
        prompt_lens.append(n)
        stops.append(STOP_IDS if position - n < p.min_tokens else [])
    tensors = SamplingTensors.build(
        params,
        seeds,
        vocab,
        "cpu",
        histories=histories,
        num_prompt_tokens=prompt_lens,
        stop_ids=stops,
    )
    return Batch(sampler, chunks, tensors)


def _logits(g: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Peaked and flat rows; every third coarsely rounded (large ties at the top-p cut);
    the tokens the histories use ride high, so that penalties move the draws."""
    x = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 6 + 0.5)
    x[:, :HISTORY_VOCAB] += 3.0
    x[::3] = torch.round(x[::3] * 2) / 2
    x[:, STOP_IDS[0]] += 4.0  # a stop token often on top
    return x.to(dtype)


def _check_batch(
    g: torch.Generator, rows: int, vocab: int, dtype: torch.dtype, seed_base: int, race: Race
) -> None:
    batch = _make_batch(g, rows, vocab, seed_base)
    logits = _logits(g, rows, vocab, dtype)
    before = logits.clone()
    expected = batch.sampler.sample(logits, batch.chunks).tokens
    got = sample_batch(logits, batch.tensors, race)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    bad = (got != expected).nonzero().flatten().tolist()
    assert not bad, [(r, batch.sampler._seqs[r].params) for r in bad[:3]]
    assert torch.equal(logits, before)  # the input is left alone


def test_triton_race_equals_reference() -> None:
    """Unnormalised mass, zero tokens, a row of zeros, any int64 seed; vocab 1 to 50k."""
    g = torch.Generator().manual_seed(5)
    for vocab, rows in ((1, 6), (17, 48), (1000, 24), (50257, 2)):
        logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * 8
        probs = logits.softmax(-1) * 3.0
        probs[::3, : vocab // 2] = 0.0
        probs[1] = 0.0  # no mass at all: token 0
        probs[0, -1] = math.nan  # NaN is no mass, as in the reference
        seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
        got, want = triton_race(probs, seeds), REF.exponential_race(probs, seeds)
        assert torch.equal(got, want), (vocab, (got != want).nonzero().flatten().tolist())
        assert int(got[1]) == 0
    one_hot = torch.zeros(4, 3000)
    one_hot[0, 0], one_hot[1, 2999], one_hot[2, 777], one_hot[3, 5] = 1.0, 1.0, 1e-30, 1e-45
    assert triton_race(one_hot, torch.tensor([1, 2, 3, 4])).tolist() == [0, 2999, 777, 5]
    wide = torch.rand(3, 40, generator=g)[:, ::2]  # strided rows and columns
    seeds = torch.tensor([7, 8, 9])
    assert torch.equal(triton_race(wide, seeds), REF.exponential_race(wide, seeds))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_batch_equals_sampler(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    for trial in range(6):
        _check_batch(g, 64, 1000, dtype, 1000 * trial, REF.exponential_race)


def test_sample_batch_top_p_from_candidates_equals_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The top-p cut from 32 candidates a row (:mod:`model_shards.worker.top_p`): batches
    that settle there and batches that fall back to the full sort draw the same tokens."""
    monkeypatch.setattr(top_p, "CANDIDATES", 32)
    paths: list[str] = []
    real = top_p._full_sort
    monkeypatch.setattr(top_p, "_full_sort", lambda *a: paths.append("sort") or real(*a))
    g = torch.Generator().manual_seed(11)
    for trial in range(8):
        before = len(paths)
        _check_batch(g, 9, 1000, torch.float32, 500 * trial, REF.exponential_race)
        paths += ["candidates"] if len(paths) == before else []
    assert {"sort", "candidates"} <= set(paths), paths


def test_sample_batch_with_the_triton_race_equals_sampler() -> None:
    g = torch.Generator().manual_seed(12)
    _check_batch(g, 32, 64, torch.bfloat16, 77, triton_race)


def test_all_greedy_batch_is_the_masked_argmax() -> None:
    g = torch.Generator().manual_seed(13)
    sampler = Sampler(REF)
    params = [SamplingParams(temperature=0.0, min_tokens=2, seed=0), SamplingParams(0.0)]
    for row, p in enumerate(params):
        sampler.add(NewSequence(row, p, 2, stop_token_ids=STOP_IDS))
    chunks = [SeqChunk(0, 0, [1, 2]), SeqChunk(1, 0, [1, 2])]
    logits = torch.randn(2, 50, generator=g)
    logits[:, STOP_IDS[1]] = 10.0
    t = SamplingTensors.build(params, [0, 0], 50, stop_ids=[STOP_IDS, []])
    tokens = sample_batch(logits, t, REF.exponential_race)
    assert tokens.tolist() == sampler.sample(logits, chunks).tokens.tolist()
    assert int(tokens[1]) == STOP_IDS[1] and int(tokens[0]) != STOP_IDS[1]


def test_each_penalty_moves_a_greedy_row() -> None:
    """Token 5 leads token 6 by 0.5; each penalty alone (and repetition of a negative
    logit seen in the prompt) hands the row to token 6, as in the Sampler."""
    cases = [  # (params, prompt, output)
        (SamplingParams(0.0, repetition_penalty=2.0), [1, 2], [5]),
        (SamplingParams(0.0, presence_penalty=0.6), [1, 2], [5, 5]),
        (SamplingParams(0.0, frequency_penalty=0.3), [1, 2], [5, 5]),
        (SamplingParams(0.0, repetition_penalty=2.0), [5, 1], [2]),  # negative logits
        (SamplingParams(0.0, frequency_penalty=0.3), [5, 5], [1]),  # prompt: not counted
    ]
    logits = torch.full((len(cases), 8), -3.0)
    logits[:, 5], logits[:, 6] = 2.0, 1.5
    logits[3] -= 4.0  # token 5 at -2.0, token 6 at -2.5: x * r = -4.0 loses
    sampler = Sampler(REF)
    chunks = []
    for row, (p, prompt, output) in enumerate(cases):
        tokens = prompt + output
        sampler.add(NewSequence(row, p, len(prompt)))
        chunks.append(SeqChunk(row, 0, tokens))
        sampler.observe(chunks[-1])
    t = SamplingTensors.build(
        [c[0] for c in cases],
        [0] * len(cases),
        8,
        histories=[c[1] + c[2] for c in cases],
        num_prompt_tokens=[len(c[1]) for c in cases],
    )
    tokens = sample_batch(logits, t, REF.exponential_race).tolist()
    assert tokens == sampler.sample(logits, chunks).tokens.tolist() == [6, 6, 6, 6, 5]


def test_build_encodes_stages_that_are_off() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=10, top_p=0.5, min_p=0.2, seed=1),
        SamplingParams(top_k=64, top_p=1.0, seed=2),  # k >= V: off
    ]
    t = SamplingTensors.build(params, [0, 5, 2**63 - 1], 64)
    assert t.top_k.tolist() == [0, 10, 0] and t.max_top_k == 10
    assert t.top_p.tolist() == [math.inf, 0.5, math.inf] and t.any_top_p and t.any_min_p
    assert t.greedy.tolist() == [True, False, False] and not t.all_greedy
    assert t.seeds.tolist() == [0, 5, 2**63 - 1]
    assert t.prompt_mask is None and t.output_counts is None and t.stop_mask is None


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=2.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.8)],
    ids=["top_k", "top_p"],
)
def test_draws_follow_the_filtered_distribution(params: SamplingParams) -> None:
    """2000 seeds on one row: each token's share within 5 sigma, cut tokens never drawn."""
    n = 2000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(n, -1)
    seeds = [position_seed(seed, 4) for seed in range(n)]
    t = SamplingTensors.build([params] * n, seeds, 5)
    counts = torch.bincount(sample_batch(logits, t, REF.exponential_race), minlength=5)
    expected = filter_logits(logits[0] / params.temperature, params).softmax(-1)
    assert counts[expected == 0].sum() == 0
    for i in torch.nonzero(expected).flatten().tolist():
        p = float(expected[i])
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(float(counts[i]) - n * p) < 5 * sigma, (i, counts.tolist(), expected)
