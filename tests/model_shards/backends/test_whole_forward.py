"""Whole forwards on every backend: the reference backend, the cpu backend's C++ kernels
and the cuda backend's Triton kernels (in Triton's interpreter on CPU) give the same
prompt logits and greedy tokens on one tiny Llama, equal to transformers; and decode
steps replayed through the CUDA-graph runner (a fake graph backend on CPU) equal the
eager steps. ``--kv-cache-dtype fp8`` on the cuda backend gives what the reference gives
with K/V rounded to e4m3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_shards.backends import Backend, ReferenceBackend
from model_shards.backends.base import HeadNorms, KVPool, RotaryStep
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.backends.cuda.graphs import DecodeStep
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decode_graphs import DecodeGraphs
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import build_tiny_llama, hf_greedy, hf_prompt_logits
from tests.logits import prompt_logits, record_logits
from tests.model_shards.backends.cuda.fake_graphs import FakeGraphBackend

PROMPTS = [[3, 17, 250, 996, 42, 7, 512, 64, 100], [5, 6], [9] * 21]
NEW_TOKENS = 6
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "llama", sharded=False)


def _backend(name: str) -> Backend:
    if name == "cpu":
        assert build_and_load()
        return CpuBackend()
    if name == "cuda":
        from model_shards.backends.cuda.backend import CudaBackend

        return CudaBackend()
    return ReferenceBackend()


def _worker(model_dir: Path, ops: Backend) -> Worker:
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=4, block_size=4)
    return Worker.build(replica, cfg, Comm(single_process_state()), MAX_LEN, ops=ops)


def _generate(
    worker: Worker, prompts: list[list[int]] = PROMPTS, new_tokens: int = NEW_TOKENS
) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Prompt logits of each prompt, then greedy tokens of all prompts batched together
    (prefill chunks of different lengths in one step, then decode-only steps)."""
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN)
    logits = prompt_logits(coord, recorder, prompts)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(0.0)
        coord.add_request(GenerateRequest(str(i), prompt, new_tokens, params, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while coord.has_work():
        for update in coord.step():
            tokens[update.output.request_id] += update.output.new_token_ids
    return logits, tokens


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    return _generate(_worker(model_dir, ReferenceBackend()))


def test_reference_backend_equals_transformers(
    model_dir: Path, reference: tuple[list[torch.Tensor], dict[str, list[int]]]
) -> None:
    logits, tokens = reference
    for i, prompt in enumerate(PROMPTS):
        ref = hf_prompt_logits(model_dir, prompt)[-1]
        assert ((logits[i] - ref).abs().max() / ref.abs().max()).item() < 1e-4
        assert tokens[str(i)] == hf_greedy(model_dir, prompt, NEW_TOKENS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["cpu", "cuda"], ids=["cpu", "cuda-interpreted"])
def test_backend_whole_forward_equals_reference(
    name: str, model_dir: Path, reference: tuple[list[torch.Tensor], dict[str, list[int]]]
) -> None:
    logits, tokens = _generate(_worker(model_dir, _backend(name)))
    ref_logits, ref_tokens = reference
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4, name
    assert tokens == ref_tokens, name


class _E4m3KVReference(ReferenceBackend):
    """The reference backend on float pools that hold K/V rounded to e4m3 (scale 1)."""

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        step: RotaryStep,
        pool: KVPool,
        heads: tuple[int, int],
        norms: HeadNorms | None = None,
    ) -> torch.Tensor:
        q = super().rotary_and_cache(qkv, step, pool, heads, norms)
        slots = step.slot_mapping[step.slot_mapping >= 0]
        for buf in (pool.k, pool.v):
            buf[slots] = buf[slots].clamp(-448, 448).to(torch.float8_e4m3fn).to(buf.dtype)
        return q


@pytest.mark.timeout(240)
def test_fp8_kv_cache_whole_forward(model_dir: Path) -> None:
    """``--kv-cache-dtype fp8`` through a worker of the cuda backend (interpreted): e4m3 pools
    sized at one byte per element; prompt logits and greedy tokens those of the reference
    backend whose float pools hold the same e4m3-rounded K/V."""
    cfg = ModelConfig.from_dir(model_dir)
    per_block = cfg.kv_block_bytes(1, cfg.num_layers, 4, 1)  # K and V of every layer, 1 byte
    budget = 40 * per_block  # 10 blocks in float32: too few for one 64-token sequence
    replica = ReplicaConfig(
        str(model_dir), dtype="float32", max_num_seqs=4, block_size=4, kv_cache_memory=budget,
        kv_cache_dtype="fp8",
    )  # fmt: skip
    comm = Comm(single_process_state())
    worker = Worker.build(replica, cfg, comm, MAX_LEN, ops=_backend("cuda"))
    assert worker.kv.num_blocks == 40
    assert worker.kv.pools[0].k.dtype == torch.float8_e4m3fn
    logits, tokens = _generate(worker, PROMPTS[:2], 3)
    ref_logits, ref_tokens = _generate(_worker(model_dir, _E4m3KVReference()), PROMPTS[:2], 3)
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert tokens == ref_tokens


def test_decode_graph_replays_equal_eager_steps(
    model_dir: Path, reference: tuple[list[torch.Tensor], dict[str, list[int]]]
) -> None:
    worker = _worker(model_dir, ReferenceBackend())
    fake = FakeGraphBackend()
    worker.graphs = DecodeGraphs(worker.model, worker.kv, 4, MAX_LEN, fake)
    worker.graphs.capture()
    assert fake.captures == 3  # buckets 1, 2, 4
    logits, tokens = _generate(worker)
    assert tokens == reference[1]
    assert fake.replays >= NEW_TOKENS - 1  # the decode-only steps replayed a graph
    for ours, ref in zip(logits, reference[0], strict=True):
        assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-6)


def _two_bound_cuda() -> Backend:
    """The cuda backend with decode graphs at context bounds 24 and 64 (its own
    threshold lies far above this model's 64 positions); the 21-token prompt's decode
    steps reach contexts 22 .. 26, so both replay."""
    from model_shards.backends.cuda.backend import CudaBackend

    class TwoBounds(CudaBackend):
        def decode_context_bounds(self, rows: int, kv_heads: int, max_context: int) -> list[int]:
            return [24, max_context]

    return TwoBounds()


def test_decode_graphs_per_context_bound_equal_eager_steps(
    model_dir: Path, reference: tuple[list[torch.Tensor], dict[str, list[int]]]
) -> None:
    """The cuda backend (interpreted) with two context bounds a bucket: the short and the
    long graphs both replay, and the tokens and logits are the eager reference's."""
    ops = _two_bound_cuda()
    worker = _worker(model_dir, ops)
    fake = FakeGraphBackend()
    worker.graphs = DecodeGraphs(worker.model, worker.kv, 4, MAX_LEN, fake, ops)
    worker.graphs.capture()
    assert fake.captures == 6  # buckets 1, 2, 4 at bounds 24 and 64
    keys: list[tuple[int, int | None] | None] = []
    runner = worker.graphs.runner
    run = runner.run

    def keyed_run(step: DecodeStep) -> torch.Tensor:
        keys.append(runner.graph_key(step))
        return run(step)

    runner.run = keyed_run  # type: ignore[method-assign]
    logits, tokens = _generate(worker)
    assert tokens == reference[1]
    assert {k[1] for k in keys if k is not None} == {24, MAX_LEN}
    for ours, ref in zip(logits, reference[0], strict=True):
        assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-5)
