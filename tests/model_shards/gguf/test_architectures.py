"""GGUF metadata → the HF config each served architecture would have, and the tensor names
and un-doings: checked against the transformers configs the tiny GGUFs were written from."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model_shards.config.model import ModelConfig
from model_shards.config.rope import RopeConfig
from model_shards.gguf.architectures import _layer_types, hf_config, tensor_plans
from model_shards.gguf.reader import GGUFModel, read_gguf
from model_shards.layers.rotary import inverse_frequencies
from model_shards.worker.gguf_checkpoint import unpermute_rows
from tests.model_shards.gguf.tiny import SPECS, build, hf_model
from tests.model_shards.gguf.writer import converter_permute

_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias")  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-archs")
    return {arch: build(arch, root) for arch in SPECS}


@pytest.mark.parametrize("arch", list(SPECS))
def test_config_matches_the_hf_model_written(arch: str, files: dict[str, Path]) -> None:
    ours = ModelConfig.from_dir(files[arch])
    hf = hf_model(arch).config.to_dict()
    theirs = ModelConfig.from_dict({**hf, "architectures": [ours.architecture]})
    assert {f: getattr(ours, f) for f in _SHAPE} == {f: getattr(theirs, f) for f in _SHAPE}
    assert ours.rope.theta == theirs.rope.theta
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1
    assert ours.torch_dtype == "float32"
    if arch.startswith("gemma"):  # llama.cpp's reading: scale head_dim, the window, caps
        for key in ("query_pre_attn_scalar", "sliding_window", "final_logit_softcapping"):
            assert ours.extra.get(key) == hf.get(key), key
        assert ours.extra["layer_types"] == hf["layer_types"]


def test_names_and_undoings(files: dict[str, Path]) -> None:
    llama = tensor_plans(read_gguf(files["llama"]))
    q = llama["model.layers.1.self_attn.q_proj.weight"]
    assert (q.gguf_name, q.permute_heads, q.shift) == ("blk.1.attn_q.weight", 4, 0.0)
    assert llama["model.layers.0.self_attn.k_proj.weight"].permute_heads == 2
    assert llama["lm_head.weight"].gguf_name == "output.weight"
    gemma = tensor_plans(read_gguf(files["gemma3"]))
    assert gemma["model.layers.0.pre_feedforward_layernorm.weight"].shift == 1.0
    assert gemma["model.layers.0.self_attn.q_norm.weight"].shift == 1.0
    assert gemma["model.layers.0.self_attn.q_proj.weight"].permute_heads == 0
    phi3 = tensor_plans(read_gguf(files["phi3"]))
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"].gguf_name == "blk.0.ffn_up.weight"
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"].gguf_name == "blk.0.attn_qkv.weight"


def test_unpermute_inverts_the_converter() -> None:
    rows = np.arange(3 * 8)[:, None] * np.ones((1, 2))
    stored = converter_permute(rows, 3)
    assert np.array_equal(stored[unpermute_rows(np.arange(24), 24, 3)], rows)


def _llama3_divisors(rope: RopeConfig, dim: int) -> list[float]:
    """``rope_freqs.weight`` as ``convert_hf_to_gguf.py`` computes it for Llama 3."""
    low = rope.original_max_position_embeddings / rope.low_freq_factor
    high = rope.original_max_position_embeddings / rope.high_freq_factor
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rope.theta ** (i / dim)
        smooth = (rope.original_max_position_embeddings / wavelen - 1.0) / (4.0 - 1.0)
        out.append(1.0 if wavelen < high else rope.factor if wavelen > low else
                   1 / ((1 - smooth) / rope.factor + smooth))  # fmt: skip
    return out


def test_llama3_rope_freqs_serve_as_llama3(tmp_path: Path) -> None:
    rope = RopeConfig(500000.0, "llama3", factor=8.0, original_max_position_embeddings=64)
    path = tmp_path / "l3.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    sizes = {"block_count": 1, "context_length": 256, "embedding_length": 64}
    sizes |= {"feed_forward_length": 64, "head_count": 4, "head_count_kv": 4}
    for add, value in sizes.items():
        getattr(writer, f"add_{add}")(value)
    writer.add_rope_freq_base(rope.theta)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.add_tensor("rope_freqs.weight", np.array(_llama3_divisors(rope, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = ModelConfig.from_dir(path)
    assert "rope_freqs.weight" not in tensor_plans(read_gguf(path))
    assert hf_config(read_gguf(path))["max_position_embeddings"] == 256
    ours = inverse_frequencies(16, cfg.rope, long=True)
    torch.testing.assert_close(ours, inverse_frequencies(16, cfg.rope))
    torch.testing.assert_close(ours, inverse_frequencies(16, rope), rtol=1e-6, atol=0)


def test_gemma_layer_types_follow_a_stored_pattern() -> None:
    def types(pattern: object, n: int = 3) -> list[str]:
        meta = {
            "general.architecture": "gemma3",
            "gemma3.attention.sliding_window_pattern": pattern,
        }
        return _layer_types(GGUFModel((Path("m.gguf"),), meta, {}), n, every=6)

    assert types([True, False, True]) == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    assert types(2, n=4) == ["sliding_attention", "full_attention"] * 2
    assert types(None, n=6)[-2:] == ["sliding_attention", "full_attention"]


def test_phi3_longrope_factors_and_partial_rotary(tmp_path: Path) -> None:
    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(path, "phi3")
    sizes = {"block_count": 1, "context_length": 4096, "embedding_length": 64}
    sizes |= {"feed_forward_length": 64, "head_count": 4, "head_count_kv": 4}
    sizes |= {"rope_dimension_count": 12, "sliding_window": 2047}
    for add, value in sizes.items():
        getattr(writer, f"add_{add}")(value)
    writer.add_rope_scaling_orig_ctx_len(1024)
    writer.add_rope_scaling_attn_factors(1.19)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.add_tensor("rope_factors_long.weight", np.arange(1, 7, dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.ones(6, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope.rope_type == "longrope" and cfg.rope.original_max_position_embeddings == 1024
    assert cfg.rope.long_factor == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    assert cfg.rope.short_factor == (1.0,) * 6
    assert cfg.rope.attention_factor == pytest.approx(1.19)
    assert cfg.extra["partial_rotary_factor"] == 0.75 and cfg.extra["sliding_window"] == 2047
    assert set(tensor_plans(read_gguf(path))) == {"model.embed_tokens.weight"}
