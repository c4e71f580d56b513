"""Mixed prefill + decode steps through piecewise graphs (the fake graph backend on CPU, the
cuda backend's Triton kernels in the interpreter): the buckets and pieces chosen, and every
step's logits and greedy tokens equal to the eager steps'.

A piecewise step multiplies ``n`` (its bucket) rows where the eager step multiplies ``T``:
bit for bit the same only with GEMMs whose rows do not depend on M, hence the
batch-invariant backend here (torch's and cuBLAS's pick kernels by M: last-bit changes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_shards.backends.cuda.backend import CudaBackend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams, SeqChunk
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from model_shards.worker.piecewise_graphs import piecewise_for, token_buckets
from model_shards.worker.sampler import SampleOutput, Sampler
from tests.checkpoints import build_tiny_llama
from tests.model_shards.backends.cuda.fake_graphs import FakeGraphBackend

MAX_TOKENS = 40  # buckets 16, 32, 40
# A arrives alone; B and C join while A decodes: steps of prefill chunks beside decodes
ARRIVALS = [(0, [3, 17, 250, 996, 42, 7, 512, 64, 100]), (1, [5, 6, 9] * 7), (2, [11] * 5)]
NEW_TOKENS = 4


class StepSampler(Sampler):
    """Keeps every step's logits (float32 CPU copies), in order."""

    def __init__(self, sampler: Sampler) -> None:
        super().__init__(sampler.ops)
        self.steps: list[torch.Tensor] = []

    def sample(self, logits: torch.Tensor, chunks: list[SeqChunk]) -> SampleOutput:
        self.steps.append(logits.float().cpu().clone())
        return super().sample(logits, chunks)


def test_token_buckets() -> None:
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(40) == [16, 32, 40]
    assert token_buckets(8) == [8]
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_buckets(0)


def _serve(model_dir: Path, fake: FakeGraphBackend | None) -> tuple[Worker, StepSampler, dict]:
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=4, block_size=4)
    ops = CudaBackend(batch_invariant=True)  # GEMMs whose rows do not depend on M
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 64, ops=ops)
    if fake is not None:
        worker.piecewise = piecewise_for(
            worker.model, fake, MAX_TOKENS, torch.device("cpu"), torch.float32
        )
        assert worker.piecewise is not None
        worker.piecewise.capture()
    recorder = StepSampler(worker.sampler)
    worker.sampler = recorder
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS, max_model_len=64)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step == 0 or coord.has_work():
        for at, prompt in ARRIVALS:
            if at == step:
                req = GenerateRequest(
                    str(at), prompt, NEW_TOKENS, SamplingParams(0.0), ignore_eos=True
                )
                coord.add_request(req)
        for update in coord.step():
            tokens.setdefault(update.output.request_id, []).extend(update.output.new_token_ids)
        step += 1
    return worker, recorder, tokens


@pytest.mark.timeout(240)
def test_mixed_steps_replayed_piecewise_equal_eager(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=False)
    _, eager_steps, eager_tokens = _serve(model_dir, None)
    fake = FakeGraphBackend()
    worker, steps, tokens = _serve(model_dir, fake)
    graphs = worker.piecewise
    assert graphs is not None and graphs.buckets == [16, 32, 40]
    assert graphs.split.num_pieces == 5  # 4 layers: 5 pieces, 4 attention cores between
    assert fake.captures == 3 * 5
    assert (graphs.bucket(1), graphs.bucket(17), graphs.bucket(40), graphs.bucket(41)) == (
        16,
        32,
        40,
        None,
    )
    assert fake.replays > 0 and fake.replays % 5 == 0  # whole steps, piece by piece
    assert tokens == eager_tokens and all(len(t) == NEW_TOKENS for t in tokens.values())
    assert len(steps.steps) == len(eager_steps.steps)
    for ours, ref in zip(steps.steps, eager_steps.steps, strict=True):
        assert torch.equal(ours, ref)


def test_stacks_that_do_not_cut_run_eagerly(tmp_path: Path) -> None:
    from model_shards.backends import ReferenceBackend
    from tests.families import gpt2

    model_dir = gpt2.build(tmp_path / "gpt2")
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=2, block_size=4)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 32, ops=ReferenceBackend())
    cpu = torch.device("cpu")
    assert piecewise_for(worker.model, FakeGraphBackend(), 64, cpu, torch.float32) is None
    assert worker.piecewise is None  # and none unless SHARDSERVE_PIECEWISE_GRAPHS=1
