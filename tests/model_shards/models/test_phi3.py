"""Phi-3 beyond the family parity harness: the released variants' shapes against
transformers at tp=1 (Phi-3 mini 4k: plain RoPE and a window no longer than the served
length; mini 128k: LongRoPE on the whole head; Phi-4 mini: partial rotary and a tied head),
what is refused naming the field, the older ``config.json`` spellings, and strict loading
of the fused tensors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_shards.backends import ReferenceBackend
from model_shards.config.kv_layout import layer_windows
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.layers.context import ShardContext
from model_shards.models.phi3 import Phi3ForCausalLM, Phi3Options
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.checkpoint import Checkpoint, CheckpointError
from model_shards.worker.decoder_worker import Worker
from model_shards.worker.loader import load_weights
from tests.checkpoints import hf_prompt_logits
from tests.families import phi3
from tests.logits import prompt_logits, record_logits

MAX_LEN = 128
PROMPTS = [[3, 17, 250, 96, 42, 7, 51, 64, 100, 12, 900], [5, 6]]
VARIANTS: dict[str, dict[str, Any]] = {
    "mini-4k": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_window": MAX_LEN,  # served with --max-model-len <= the window
    },
    "mini-128k": {"rope_parameters": phi3.longrope(1.0)},
    "phi4-mini": {"tie_word_embeddings": True},
}


def _raw(**overrides: Any) -> dict[str, Any]:
    return phi3.config(**overrides).to_dict() | {"architectures": ["Phi3ForCausalLM"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_prompt_logits_match_transformers(tmp_path: Path, variant: str) -> None:
    path = phi3.build(tmp_path / variant, **VARIANTS[variant])
    cfg = ModelConfig.from_dir(path)
    replica = ReplicaConfig(str(path), dtype="float32", max_num_seqs=4, block_size=4)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), MAX_LEN)
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=MAX_LEN)
    for prompt, ours in zip(PROMPTS, prompt_logits(coord, recorder, PROMPTS), strict=True):
        ref = hf_prompt_logits(path, prompt)[-1]
        rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{variant}: logits relative error {rel:.2e}"


def test_window_shorter_than_the_served_length_is_served_on_every_layer() -> None:
    cfg = ModelConfig.from_dict(_raw(sliding_window=16))
    assert Phi3Options.parse(cfg, max_positions=128).sliding_window == 16
    assert set(layer_windows(cfg)) == {16}
    long = ModelConfig.from_dict(_raw(sliding_window=10**6))  # past every position
    assert set(layer_windows(long)) == {None}
    assert Phi3Options.parse(ModelConfig.from_dict(_raw(sliding_window=None)), 4096).rotary_dim
    with pytest.raises(ValueError, match=r"hidden_act 'gelu'"):
        Phi3ForCausalLM.check_config(ModelConfig.from_dict(_raw(hidden_act="gelu")), 64)


def test_longrope_factors_not_one_per_rotated_frequency_are_refused() -> None:
    raw = _raw()
    raw["rope_parameters"] = dict(raw["rope_parameters"])
    raw["rope_parameters"]["long_factor"] = raw["rope_parameters"]["long_factor"][:-1]
    cfg = ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match=r"long_factor has \d+ entries"):
        Phi3ForCausalLM.check_config(cfg, 64)


def test_older_config_spellings() -> None:
    """transformers < 5: ``rope_scaling`` typed ``su``, ``rope_theta`` and
    ``partial_rotary_factor`` at the top level; the top-level original maximum wins."""
    raw = _raw()
    del raw["rope_parameters"]
    rope = phi3.longrope(1.0)
    raw |= {
        "rope_theta": 5000.0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 32,
        "rope_scaling": {
            "type": "su",
            "short_factor": rope["short_factor"][:4],
            "long_factor": rope["long_factor"][:4],
            "original_max_position_embeddings": 99,
        },
    }
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope.rope_type, cfg.rope.theta) == ("longrope", 5000.0)
    assert cfg.rope.original_max_position_embeddings == 32
    assert cfg.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    assert Phi3Options.parse(cfg, 64).rotary_dim == 8
    raw["rope_scaling"] |= {"attention_factor": 1.25}
    assert ModelConfig.from_dict(raw).rope.attention_factor == 1.25


def test_split_projection_names_are_refused(tmp_path: Path) -> None:
    path = phi3.build(tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    gate_up = tensors.pop("model.layers.1.mlp.gate_up_proj.weight")
    tensors["model.layers.1.mlp.gate_proj.weight"] = gate_up[: gate_up.shape[0] // 2].clone()
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, str(broken / "model.safetensors"))
    cfg = ModelConfig.from_dir(path)
    model = Phi3ForCausalLM(cfg, ShardContext.single_process(ReferenceBackend()), MAX_LEN)
    with (
        Checkpoint(broken) as ckpt,
        pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.gate_proj"),
    ):
        load_weights(model, ckpt)
    with Checkpoint(path) as ckpt:
        load_weights(model, ckpt)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
