"""The draft model's proposals (in-process, the tiny Llama as the draft, a pool of 8 blocks of 4):
transformers' greedy tokens, after a rejection (the draft's K/V past the common prefix written
over), for two sequences in one batch, and after the pool ran short (the least recently
proposed-for sequence forgotten, then caught up again from its first token). Every block is
free after :meth:`DraftModel.free`."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_shards.engine.speculative.draft_model import DraftModel
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from tests.checkpoints import build_tiny_llama, hf_greedy
from tests.model_shards.engine.engine_harness import build_worker

K = 3


@pytest.mark.timeout(120)
def test_proposals_are_the_greedy_tokens(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=False)
    draft = DraftModel(build_worker(Comm(single_process_state()), str(model_dir), 8, 32))
    a, b = [5, 9, 200, 17, 3, 3, 81, 12], list(range(40, 60))

    def want(tokens: list[int]) -> list[int]:
        return hf_greedy(model_dir, tokens, K)

    first = draft.propose({1: (a, K)})[1]
    assert first == want(a)
    rejected = [*a, first[0], (first[1] + 1) % 1000]  # one draft accepted, then another token
    assert draft.propose({1: (rejected, K)})[1] == want(rejected)
    assert draft.num_free_blocks == 8 - 3  # positions 0..11 of sequence 1
    # two sequences in one batch, 3 blocks each
    both = draft.propose({1: (rejected, 1), 2: (b[:10], K)})
    assert both == {1: want(rejected)[:1], 2: want(b[:10])}
    assert draft.num_free_blocks == 2
    # sequence 2 grows to 6 blocks: sequence 1 (not asked for) is forgotten
    assert draft.propose({2: (b, K)})[2] == want(b)
    assert draft.num_free_blocks == 2
    assert draft.propose({1: (a, K)})[1] == first  # caught up again, forgetting 2
    assert draft.num_free_blocks == 5
    draft.free([1, 2])
    assert draft.num_free_blocks == 8
