"""The sampler's math on its own: the draw's distribution, the filters, the penalties,
min_tokens, logprobs, and the independence of a row from the rest of the batch.

Engine-level tests (tests/model_shards/engine/test_engine_batching.py) show the same seeded
text whatever the batch; these pin down what each parameter does to the numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from model_shards.backends import ReferenceBackend
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.messages import SamplingParams, SeqChunk
from model_shards.worker.sampler import apply_penalties, filter_logits
from tests.model_shards.worker.sampler_cases import OnDeviceReference, make_sampler


def _race(probs: torch.Tensor, seeds: torch.Tensor, kernel: bool) -> torch.Tensor:
    if kernel:
        assert build_and_load()
        return CpuBackend().exponential_race(probs, seeds)
    return ReferenceBackend().exponential_race(probs, seeds)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_race_follows_the_distribution_and_never_picks_zero_mass(kernel: bool) -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.15, 0.1, 0.0])
    n = 20_000
    tokens = _race(probs.expand(n, -1).contiguous(), torch.arange(n) * 7919, kernel)
    counts = torch.bincount(tokens, minlength=7).float()
    assert counts[probs == 0].sum() == 0
    for i in torch.nonzero(probs).flatten().tolist():
        sigma = math.sqrt(n * probs[i] * (1 - probs[i]))
        assert abs(counts[i] - n * probs[i]) < 5 * sigma, (i, counts.tolist())


def test_race_kernel_equals_reference() -> None:
    """The same token for every row: unnormalized mass, peaked and flat rows, 49k vocab."""
    g = torch.Generator().manual_seed(5)
    for vocab, rows in ((7, 500), (1000, 200), (49152, 16)):
        logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * 8
        probs = logits.softmax(-1) * 3.0
        probs[::3, : vocab // 2] = 0.0
        seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g)
        fast, ref = _race(probs, seeds, True), _race(probs, seeds, False)
        assert torch.equal(fast, ref), (vocab, (fast != ref).nonzero().flatten().tolist())
        assert torch.equal(fast, _race(probs, seeds, True))  # a pure function of its inputs
    one_hot = torch.zeros(3, 49152)
    one_hot[0, 0], one_hot[1, 49151], one_hot[2, 777] = 1.0, 1.0, 1e-30
    seeds = torch.tensor([1, 2, 3])
    for kernel in (True, False):
        assert _race(one_hot, seeds, kernel).tolist() == [0, 49151, 777]


def test_race_moves_only_near_a_tie() -> None:
    """Tiny noise on the probabilities (a replay's prefill vs the original decode) leaves
    almost every draw as it was."""
    g = torch.Generator().manual_seed(9)
    probs = (torch.randn(400, 5000, generator=g) * 2).softmax(-1)
    noisy = probs * (1 + 1e-3 * torch.randn(probs.shape, generator=g))
    seeds = torch.arange(400)
    same = (_race(probs, seeds, True) == _race(noisy, seeds, True)).float().mean()
    assert same > 0.99


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = filter_logits(logits, SamplingParams(top_k=2)).isfinite()
    assert kept.tolist() == [False, True, False, True, False]
    assert filter_logits(logits, SamplingParams(top_k=0)).isfinite().all()


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.1, 0.4, 0.3, 0.2])
    logits = probs.log()
    assert filter_logits(logits, SamplingParams(top_p=0.7)).isfinite().tolist() == [
        False,
        True,
        True,
        False,
    ]
    assert filter_logits(logits, SamplingParams(top_p=0.75)).isfinite().tolist() == [
        False,
        True,
        True,
        True,
    ]
    only_top = filter_logits(logits, SamplingParams(top_p=0.01)).isfinite()
    assert only_top.tolist() == [False, True, False, False]  # the top token always stays


def test_min_p_drops_tokens_below_a_share_of_the_top() -> None:
    logits = torch.tensor([0.5, 0.2, 0.05, 0.25]).log()
    kept = filter_logits(logits, SamplingParams(min_p=0.45)).isfinite()
    assert kept.tolist() == [True, False, False, True]


def test_penalties_follow_vllm() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0])
    prompt, output = [0], [1, 3, 3]
    rep = apply_penalties(logits, prompt, output, SamplingParams(repetition_penalty=2.0))
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.25, -1.0]  # seen: divide positive, multiply negative
    freq = apply_penalties(logits, prompt, output, SamplingParams(frequency_penalty=0.5))
    assert freq.tolist() == [2.0, -2.5, 1.0, -0.5, -1.0]  # output counts only, not the prompt
    pres = apply_penalties(logits, prompt, output, SamplingParams(presence_penalty=0.5))
    assert pres.tolist() == [2.0, -2.5, 1.0, 0.0, -1.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5, -1.0]  # the input is left alone


def _chunk(seq_id: int, pos: int) -> SeqChunk:
    return SeqChunk(seq_id, pos, [1])


def test_a_seeded_row_draws_the_same_whatever_else_is_in_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    params = {i: SamplingParams(temperature=1.3, top_p=0.9, seed=100 + i) for i in range(3)}
    params[3] = SamplingParams(temperature=0.0)
    params[4] = SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=7)
    params[5] = SamplingParams(temperature=1.0, seed=8)
    sampler = make_sampler(params)
    together = sampler.sample(logits, [_chunk(i, 5) for i in range(6)]).tokens
    for i in range(6):
        alone = sampler.sample(logits[i : i + 1], [_chunk(i, 5)]).tokens
        assert alone.tolist() == [int(together[i])], i
    assert int(together[3]) == int(logits[3].argmax())
    # the position is part of the seed: other positions draw other tokens
    moved = [int(sampler.sample(logits[5:], [_chunk(5, p)]).tokens[0]) for p in range(5, 25)]
    assert len(set(moved)) > 1


def test_sampled_tokens_follow_temperature_and_filters() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 3000
    p = SamplingParams(temperature=2.0, top_k=3, seed=0)
    tokens = []
    for seed in range(n):
        sampler = make_sampler({0: SamplingParams(temperature=2.0, top_k=3, seed=seed)})
        tokens.append(int(sampler.sample(logits, [_chunk(0, 4)]).tokens[0]))
    expected = filter_logits(logits[0] / p.temperature, p).softmax(-1)
    for i in range(5):
        share = tokens.count(i) / n
        if expected[i] == 0:
            assert share == 0, i
        else:
            sigma = math.sqrt(expected[i] * (1 - expected[i]) / n)
            assert abs(share - expected[i]) < 5 * sigma, (i, share, expected[i])


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    logits = torch.full((1, 6), -5.0)
    logits[0, 3] = 5.0  # the stop token is the argmax
    sampler = make_sampler({0: SamplingParams(temperature=0.0, min_tokens=2)}, prompt_len=2)
    prefill = SeqChunk(0, 0, [1, 1])  # samples the 1st output token
    assert int(sampler.sample(logits, [prefill]).tokens[0]) != 3
    assert int(sampler.sample(logits, [_chunk(0, 2)]).tokens[0]) != 3  # the 2nd
    assert int(sampler.sample(logits, [_chunk(0, 3)]).tokens[0]) == 3  # the 3rd: allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_raw_model_distribution(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g).to(dtype)
    params = {
        0: SamplingParams(temperature=0.0, logprobs=5),
        1: SamplingParams(temperature=0.5, seed=3, logprobs=2, repetition_penalty=1.5),
        2: SamplingParams(temperature=0.0),
    }
    sampler = make_sampler(params)
    out = sampler.sample(logits, [_chunk(i, 2) for i in range(3)])
    ref = logits.float().log_softmax(-1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (3, 5)  # the largest N asked for in the step
    torch.testing.assert_close(out.top_logprobs, ref.topk(5).values)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None])[:, 0])
    assert out.tokens[0] == logits[0].float().argmax() and out.tokens[2] == logits[2].argmax()


def test_on_device_path_samples_what_the_host_path_does() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 300, generator=g)
    params = {
        0: SamplingParams(temperature=0.0),
        1: SamplingParams(temperature=1.1, top_p=0.8, seed=5),
        2: SamplingParams(temperature=0.7, top_k=9, seed=6, logprobs=3),
        3: SamplingParams(temperature=1.0, min_p=0.2, seed=7),
        4: SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
        5: SamplingParams(temperature=0.9, presence_penalty=0.8, seed=8),
        6: SamplingParams(temperature=0.0, min_tokens=10),  # its stop id 3 masked
        7: SamplingParams(temperature=1.3, seed=9),
    }
    host, device = make_sampler(params), make_sampler(params)
    device.ops = OnDeviceReference()
    for sampler in (host, device):
        for seq_id in params:
            sampler.observe(SeqChunk(seq_id, 0, [1, 3, 7, 7, 250]))  # histories for penalties
    logits[6, 3] = 100.0  # the stop token would win were it not masked
    chunks = [_chunk(i, 5) for i in range(8)]
    want, got = host.sample(logits, chunks), device.sample(logits, chunks)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.tokens[6] != 3
    assert want.logprobs is not None and got.logprobs is not None
    assert torch.allclose(got.logprobs, want.logprobs)
    assert got.top_ids is not None and want.top_ids is not None
    assert torch.equal(got.top_ids, want.top_ids)
