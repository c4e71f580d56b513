"""Token bitmasks and logit adjustments in the sampler.

* :func:`bitmask.unpack` / :func:`bitmask.adjust_logits` mask exactly what xgrammar's own
  ``apply_token_bitmask_inplace`` masks, and :func:`bitmask.pack` is its inverse;
* a grammar mask, ``logit_bias`` and ``allowed_token_ids`` steer the host path and the
  batched on-device path to the same tokens, and leave other rows (and the logprobs,
  which are the raw model's) alone.
"""

from __future__ import annotations

import torch
import xgrammar

from model_shards.engine.structured import bitmask
from model_shards.messages import NewSequence, SamplingParams, SeqChunk, TokenMask
from model_shards.worker.sampler import Sampler
from tests.model_shards.worker.sampler_cases import OnDeviceReference, make_sampler

VOCAB = 300


def _random_words(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask.num_words(VOCAB)), generator=g)
    return words.to(torch.int32)


def test_masks_match_xgrammar() -> None:
    words = _random_words(4, 0)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, words)
    rows = [bitmask.RowAdjustment(r, mask=words[r]) for r in range(4)]
    assert torch.equal(bitmask.adjust_logits(logits, rows), theirs)
    allowed = [3, 31, 32, 33, 64, 299]
    assert (
        bitmask.unpack(bitmask.pack(allowed, VOCAB)[None], VOCAB)[0].nonzero()[:, 0].tolist()
        == allowed
    )


def _masked_sampler(params: dict[int, SamplingParams], masks: dict[int, list[int]]) -> Sampler:
    sampler = make_sampler(params)
    sampler.set_masks(
        [TokenMask(s, bitmask.pack(ids, VOCAB).numpy().tobytes()) for s, ids in masks.items()]
    )
    return sampler


def test_grammar_mask_bias_and_allowed_ids_on_both_paths() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=g)
    params = {
        0: SamplingParams(temperature=0.0),  # masked to {5, 6}
        1: SamplingParams(temperature=1.0, seed=3),  # masked to {7, 8, 9}, drawn
        2: SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
        3: SamplingParams(temperature=0.8, seed=4, allowed_token_ids=[20, 21]),
        4: SamplingParams(temperature=0.0),  # free
        5: SamplingParams(temperature=0.9, seed=5, logprobs=2, repetition_penalty=1.3),
    }
    masks = {0: [5, 6], 1: [7, 8, 9], 5: [40, 41, 42]}
    chunks = [SeqChunk(i, 4, [1]) for i in range(6)]
    host = _masked_sampler(params, masks)
    device = _masked_sampler(params, masks)
    device.ops = OnDeviceReference()
    want, got = host.sample(logits, chunks), device.sample(logits, chunks)
    tokens = want.tokens.tolist()
    assert got.tokens.tolist() == tokens
    assert tokens[0] == 5 + int(logits[0, 6] > logits[0, 5])
    assert tokens[1] in (7, 8, 9) and tokens[2] == 11 and tokens[3] in (20, 21)
    assert tokens[4] == int(logits[4].argmax()) and tokens[5] in (40, 41, 42)
    assert want.logprobs is not None and got.logprobs is not None
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(want.logprobs, raw.gather(1, want.tokens[:, None])[:, 0])
    torch.testing.assert_close(got.logprobs, want.logprobs)
    free = Sampler(host.ops)
    free.add(NewSequence(4, params[4], 2))
    assert free.sample(logits[4:5], [chunks[4]]).tokens.tolist() == [tokens[4]]


def test_masks_last_one_step() -> None:
    params = {0: SamplingParams(temperature=0.0)}
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6))
    sampler = _masked_sampler(params, {0: [100]})
    assert sampler.sample(logits, [SeqChunk(0, 4, [1])]).tokens.tolist() == [100]
    sampler.set_masks([])
    assert sampler.sample(logits, [SeqChunk(0, 5, [1])]).tokens.tolist() == [int(logits.argmax())]


def test_bad_words_ban_their_last_token_after_the_rest() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 8] = 5.0  # the favourite
    logits[0, 9] = 4.0  # the next best
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[7, 8], [12]])
    sampler = Sampler(OnDeviceReference())
    sampler.add(NewSequence(0, params, 2))
    sampler.observe(SeqChunk(0, 0, [1, 2, 7]))  # prompt [1, 2], output [7]
    assert sampler.sample(logits, [SeqChunk(0, 2, [7])]).tokens.tolist() == [9]
    sampler.observe(SeqChunk(0, 3, [5]))  # output [7, 5]: the word is not being written
    assert sampler.sample(logits, [SeqChunk(0, 3, [5])]).tokens.tolist() == [8]
    logits[0, 12] = 9.0
    assert sampler.sample(logits, [SeqChunk(0, 3, [5])]).tokens.tolist() == [8]
