"""Mixed prefill + decode steps through piecewise graphs (the fake graph backend on CPU, the
cuda backend's Triton kernels in the interpreter): the buckets and pieces chosen, and every
step's logits and greedy tokens equal to the eager steps'.

A piecewise step multiplies ``n`` (its bucket) rows where the eager step multiplies ``T``:
bit for bit the same only with GEMMs whose rows do not depend on M, hence the
batch-invariant backend here (torch's and cuBLAS's pick kernels by M: last-bit changes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_shards.backends import Backend, ReferenceBackend
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
from tests.world import run_world

MAX_TOKENS = 40  # buckets 16, 32, 40
# A arrives alone; B and C join while A decodes: steps of prefill chunks beside decodes
ARRIVALS = [(0, [3, 17, 250, 996, 42, 7, 512, 64, 100]), (1, [5, 6, 9] * 7), (2, [11] * 5)]
NEW_TOKENS = 4


class StepSampler(Sampler):
    """Keeps every step's logits and each sequence's rows (float32 CPU copies), in order."""

    def __init__(self, sampler: Sampler) -> None:
        super().__init__(sampler.ops)
        self.steps: list[torch.Tensor] = []
        self.rows: dict[int, list[torch.Tensor]] = {}

    def sample(self, logits: torch.Tensor, chunks: list[SeqChunk]) -> SampleOutput:
        self.steps.append(logits.float().cpu().clone())
        for row, chunk in enumerate(chunks):
            self.rows.setdefault(chunk.seq_id, []).append(self.steps[-1][row])
        return super().sample(logits, chunks)


def test_token_buckets() -> None:
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(40) == [16, 32, 40]
    assert token_buckets(8) == [8]
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_buckets(0)


def _build(
    model_dir: Path, comm: Comm, fake: FakeGraphBackend | None, ops: Backend | None = None
) -> tuple[Worker, StepSampler]:
    """A worker on ``ops`` (default: the cuda backend with GEMMs whose rows do not depend on
    M, in the interpreter), with piecewise graphs behind ``fake`` if given."""
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=4, block_size=4)
    ops = ops or CudaBackend(batch_invariant=True)
    worker = Worker.build(replica, cfg, comm, 64, ops=ops)
    if fake is not None:
        cpu = torch.device("cpu")
        worker.piecewise = piecewise_for(worker.model, fake, MAX_TOKENS, cpu, torch.float32)
        assert worker.piecewise is not None
        worker.piecewise.capture()
    recorder = StepSampler(worker.sampler)
    worker.sampler = recorder
    return worker, recorder


def _drive(worker: Worker) -> dict[str, list[int]]:
    """Rank 0: :data:`ARRIVALS` to their ends; each request's greedy tokens."""
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS, max_model_len=64)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step == 0 or coord.has_work():
        for at, prompt in ARRIVALS:
            if at == step:
                greedy = SamplingParams(0.0)
                coord.add_request(
                    GenerateRequest(str(at), prompt, NEW_TOKENS, greedy, ignore_eos=True)
                )
        for update in coord.step():
            tokens.setdefault(update.output.request_id, []).extend(update.output.new_token_ids)
        step += 1
    coord.shutdown()
    return tokens


def _serve(
    model_dir: Path, fake: FakeGraphBackend | None, ops: Backend | None = None
) -> tuple[Worker, StepSampler, dict]:
    worker, recorder = _build(model_dir, Comm(single_process_state()), fake, ops)
    return worker, recorder, _drive(worker)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "llama", sharded=False)


@pytest.fixture(scope="module")
def eager(model_dir: Path) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    _, steps, tokens = _serve(model_dir, None)
    return steps.steps, tokens


@pytest.mark.timeout(240)
def test_mixed_steps_replayed_piecewise_equal_eager(
    model_dir: Path, eager: tuple[list[torch.Tensor], dict[str, list[int]]]
) -> None:
    eager_steps, eager_tokens = eager
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
    assert len(steps.steps) == len(eager_steps)
    for ours, ref in zip(steps.steps, eager_steps, strict=True):
        assert torch.equal(ours, ref)


def _pp_rank(peers: Comm, model_dir: str, out: str) -> None:
    """pp=2 on the reference backend: each stage's pieces (stage 1's take stage 0's hidden
    rows); its results to ``out``."""
    fake = FakeGraphBackend()
    worker, recorder = _build(Path(model_dir), peers, fake, ReferenceBackend())
    assert worker.piecewise is not None and worker.piecewise.split.num_pieces == 3  # 2 layers
    if peers.ps.rank == 0:
        tokens = _drive(worker)
        Path(out, "tokens.json").write_text(json.dumps(tokens))
    else:
        worker.serve_forever()
        torch.save(recorder.rows, Path(out, "rows.pt"))
    assert fake.replays > 0


@pytest.mark.timeout(240)
def test_pipeline_stages_replay_piecewise_like_eager(model_dir: Path, tmp_path: Path) -> None:
    """torch's GEMMs pick kernels by M: the same tokens, logits to float32 rounding."""
    _, eager_steps, eager_tokens = _serve(model_dir, None, ReferenceBackend())
    run_world(_pp_rank, 1, 2, str(model_dir), str(tmp_path), timeout=200)
    assert json.loads((tmp_path / "tokens.json").read_text()) == eager_tokens
    rows = torch.load(tmp_path / "rows.pt")  # per sequence: the stages overlap micro-batches
    assert rows.keys() == eager_steps.rows.keys()
    for seq, ref in eager_steps.rows.items():
        torch.testing.assert_close(torch.stack(rows[seq]), torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_stacks_that_do_not_cut_run_eagerly(tmp_path: Path) -> None:
    from tests.families import gpt2

    model_dir = gpt2.build(tmp_path / "gpt2")
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=2, block_size=4)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 32, ops=ReferenceBackend())
    cpu = torch.device("cpu")
    assert piecewise_for(worker.model, FakeGraphBackend(), 64, cpu, torch.float32) is None
    assert worker.piecewise is None  # and none unless SHARDSERVE_PIECEWISE_GRAPHS=1
