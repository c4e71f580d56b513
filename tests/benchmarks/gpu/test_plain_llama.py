"""The gpu-check ceiling's plain decoder is the model shardserve serves: on the same tiny
random checkpoint (written by the check's own builder) its prompt logits and greedy tokens
equal the reference backend's."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.gpu.build_model import write_checkpoint
from benchmarks.gpu.plain_llama import PlainConfig, PlainLlama, greedy, read_weights
from benchmarks.gpu.shapes import SMOKE
from model_shards.backends import ReferenceBackend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.logits import prompt_logits, record_logits

PROMPTS = [[3, 17, 250, 996, 42, 7, 512], [9, 8, 7, 300, 301, 2, 64]]  # equal lengths
NEW_TOKENS = 8


def _reference(model_dir: Path) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=4, block_size=4)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 64, ops=ReferenceBackend())
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    logits = prompt_logits(coord, recorder, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(0.0)
        coord.add_request(GenerateRequest(str(i), prompt, NEW_TOKENS, params, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while coord.has_work():
        for update in coord.step():
            tokens[update.output.request_id] += update.output.new_token_ids
    return logits, tokens


def test_plain_decoder_equals_the_reference_backend(tmp_path: Path) -> None:
    model_dir = tmp_path / "smoke"
    write_checkpoint(model_dir, SMOKE, "cpu", "float32")
    ref_logits, ref_tokens = _reference(model_dir)
    cfg = PlainConfig.from_dir(model_dir)
    model = PlainLlama(cfg, read_weights(model_dir, "cpu", torch.float32), len(PROMPTS), 64)
    prompts = torch.tensor(PROMPTS)
    with torch.inference_mode():
        last = model(prompts, torch.arange(prompts.shape[1]))[:, -1]  # [B, vocab]
        model.k_cache.zero_()
        model.v_cache.zero_()
        tokens = greedy(model, prompts, NEW_TOKENS)
    for i, ref in enumerate(ref_logits):
        assert ((last[i] - ref).abs().max() / ref.abs().max()).item() < 1e-5, i
    assert {str(i): row for i, row in enumerate(tokens.tolist())} == ref_tokens
    assert len(set(tokens.flatten().tolist())) > 2  # not one repeated token
