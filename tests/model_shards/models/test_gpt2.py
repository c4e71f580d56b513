"""GPT-2 beyond the family parity harness (``tests/families/gpt2.py``): the real
``config.json`` spelling, the switches it refuses by name, an untied LM head, a
checkpoint saved the way ``openai-community/gpt2`` was (from ``GPT2Model``: no
``transformer.`` prefix, the old ``attn.bias`` / ``attn.masked_bias`` mask buffers), and
the cuda backend's Triton kernels (interpreted on CPU) and decode graphs (a fake graph
backend) on GPT-2's identity rotary tables and learned positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_shards.backends import Backend, ReferenceBackend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.models.gpt2 import GPT2Options
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decode_graphs import DecodeGraphs
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import hf_prompt_logits
from tests.families import gpt2
from tests.logits import prompt_logits, record_logits
from tests.model_shards.backends.cuda.fake_graphs import FakeGraphBackend

PROMPTS = [[3, 17, 250, 96, 42, 7, 51, 64, 100], [5, 6]]

# openai-community/gpt2's config.json (no tie_word_embeddings, n_inner or dtype fields)
REAL_CONFIG: dict[str, Any] = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}


def test_the_real_config_reads_as_gpt2_small() -> None:
    cfg = ModelConfig.from_dict(REAL_CONFIG)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (768, 12, 12, 12)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (64, 3072, 1024)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (50256,)
    opts = GPT2Options.from_config(cfg)
    assert (opts.layer_norm_eps, opts.gelu_approximate) == (1e-5, "tanh")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scale_attn_by_inverse_layer_idx", True),
        ("reorder_and_upcast_attn", True),
        ("add_cross_attention", True),
        ("scale_attn_weights", False),
        ("activation_function", "relu"),
    ],
)
def test_unsupported_switches_are_refused_by_name(field: str, value: object) -> None:
    cfg = ModelConfig.from_dict({**REAL_CONFIG, field: value})
    with pytest.raises(ValueError, match=field):
        GPT2Options.from_config(cfg)


def _worker(model_dir: Path, ops: Backend | None = None) -> Worker:
    """tp=1, float32; ``ops``: the backend (default: the one chosen for the CPU)."""
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=4, block_size=4)
    return Worker.build(replica, cfg, Comm(single_process_state()), 64, ops=ops)


def _generate(worker: Worker, new_tokens: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """The logits after each prompt, then ``new_tokens`` greedy tokens of all prompts
    batched (prefills together, then decode-only steps), concatenated."""
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    logits = prompt_logits(coord, recorder, PROMPTS)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS if new_tokens else []):
        params = SamplingParams(0.0)
        coord.add_request(GenerateRequest(str(i), prompt, new_tokens, params, ignore_eos=True))
    while coord.has_work():
        for update in coord.step():
            tokens[update.output.request_id] += update.output.new_token_ids
    return logits, [t for i in range(len(PROMPTS)) for t in tokens[str(i)]]


def _logits(model_dir: Path) -> list[torch.Tensor]:
    return _generate(_worker(model_dir))[0]


def test_untied_lm_head_matches_transformers(tmp_path: Path) -> None:
    path = gpt2.build(tmp_path / "untied", tie_word_embeddings=False)
    assert "lm_head.weight" in load_file(path / "model.safetensors")
    for ours, prompt in zip(_logits(path), PROMPTS, strict=True):
        ref = hf_prompt_logits(path, prompt)[-1]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_a_base_model_checkpoint_with_mask_buffers_loads(tmp_path: Path) -> None:
    path = gpt2.build(tmp_path / "gpt2")
    before = _logits(path)
    tensors = load_file(path / "model.safetensors")
    old = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    positions = gpt2.config().n_positions
    for i in range(gpt2.config().n_layer):
        old[f"h.{i}.attn.bias"] = torch.ones(positions, positions).tril()[None, None]
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, str(path / "model.safetensors"))
    for ours, want in zip(_logits(path), before, strict=True):
        assert torch.equal(ours, want)


@pytest.mark.timeout(240)
def test_cuda_kernels_and_decode_graphs_serve_gpt2(tmp_path: Path) -> None:
    from model_shards.backends.cuda.backend import CudaBackend

    path = gpt2.build(tmp_path / "gpt2")
    ref_logits, ref_tokens = _generate(_worker(path, ReferenceBackend()), new_tokens=5)
    logits, tokens = _generate(_worker(path, CudaBackend()), new_tokens=5)
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    worker = _worker(path, ReferenceBackend())
    fake = FakeGraphBackend()
    worker.graphs = DecodeGraphs(worker.model, worker.kv, 4, 64, fake)
    worker.graphs.capture()
    assert _generate(worker, new_tokens=5)[1] == ref_tokens
    assert fake.replays >= 4  # the decode-only steps replayed a graph
