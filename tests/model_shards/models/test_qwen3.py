"""Qwen3 beyond the family parity suite (``tests/families/qwen3.py``: tied, no bias): an
untied head with q/k/v/o biases against transformers, and the config fields refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_shards.backends import ReferenceBackend
from model_shards.config.kv_layout import KVLayout, layer_windows
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.layers.context import ShardContext
from model_shards.models.qwen3 import Qwen3ForCausalLM, Qwen3Options
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import hf_prompt_logits
from tests.families import qwen3
from tests.logits import prompt_logits, record_logits


def test_untied_with_attention_bias_matches_transformers(tmp_path: Path) -> None:
    model_dir = qwen3.build(tmp_path / "q3", attention_bias=True, tie_word_embeddings=False)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    prompt = [3, 17, 250, 96, 42, 7, 51, 64, 100, 498]
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=2, block_size=4)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 64)
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    ours = prompt_logits(coord, recorder, [prompt])[0]
    ref = hf_prompt_logits(model_dir, prompt)[-1]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"relative error {rel:.2e}"


def _raw_config(**fields: Any) -> dict[str, Any]:
    raw = qwen3.config().to_dict()
    raw["architectures"] = ["Qwen3ForCausalLM"]
    raw.update(fields)
    return raw


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(fields: dict[str, Any], named: str) -> None:
    cfg = ModelConfig.from_dict(_raw_config(**fields))
    ctx = ShardContext.single_process(ReferenceBackend(), torch.float32)
    with pytest.raises(ValueError, match=named):
        Qwen3ForCausalLM(cfg, ctx, 64)


def test_sliding_window_layers_are_served_from_max_window_layers() -> None:
    """``use_sliding_window``: the layers from ``max_window_layers`` on get the window (as
    transformers builds ``layer_types``), through their own KV group."""
    raw = _raw_config(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    raw.pop("layer_types", None)
    cfg = ModelConfig.from_dict(raw)
    Qwen3ForCausalLM.check_config(cfg, 64)
    assert layer_windows(cfg) == (None, 16, 16)
    assert KVLayout.for_model(cfg).windows == (None, 16, 16)  # groups of one layer


def test_full_attention_config_builds() -> None:
    cfg = ModelConfig.from_dict(_raw_config())
    model = Qwen3ForCausalLM(cfg, ShardContext.single_process(ReferenceBackend()), 64)
    options = Qwen3Options.parse(cfg)
    assert not options.use_sliding_window
    assert options.layer_types == ("full_attention",) * 3
    names = model.expected_checkpoint_names()
    assert "model.layers.2.self_attn.q_norm.weight" in names
    assert "model.layers.0.self_attn.k_norm.weight" in names
    assert "lm_head.weight" not in names  # tied
