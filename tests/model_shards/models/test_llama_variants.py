"""Single-process checks of what the TP×PP parity suite does not cover: Mistral,
``linear`` rope scaling, reduced-precision dtypes and Llama's ``attention_bias``, each
against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from model_shards.config.kv_layout import layer_windows
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.models.llama import LlamaForCausalLM as OurLlama
from model_shards.models.stack import check_no_window
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import hf_prompt_logits
from tests.logits import prompt_logits, record_logits


def _build_mistral(path: Path, dtype: torch.dtype, sliding_window: int | None = None) -> Path:
    torch.manual_seed(0)
    cfg = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=503,
        max_position_embeddings=128,
        sliding_window=sliding_window,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        initializer_range=0.2,
    )
    MistralForCausalLM(cfg).to(dtype).save_pretrained(path)
    return path


def _logits(model_dir: Path, dtype: str, prompt: list[int]) -> torch.Tensor:
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype=dtype, max_num_seqs=2, block_size=8)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 128)
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=128)
    return prompt_logits(coord, recorder, [prompt])[0]


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 3e-2), ("float16", 1e-2)]
)
def test_mistral_linear_rope_matches_transformers(
    tmp_path: Path, dtype: str, tolerance: float
) -> None:
    torch_dtype = getattr(torch, dtype)
    model_dir = _build_mistral(tmp_path / "mistral", torch_dtype)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "MistralForCausalLM" and cfg.rope.rope_type == "linear"
    prompt = [5, 77, 300, 2, 499, 18, 64, 9, 120, 33, 7]
    ours = _logits(model_dir, "auto", prompt)  # auto: the checkpoint's own dtype
    ref_model = MistralForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0, -1].float()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < tolerance, f"{dtype}: relative error {rel:.2e}"


def test_mistral_sliding_window_matches_transformers(tmp_path: Path) -> None:
    """A window of 4 over an 11-token prompt: every layer reads only its window."""
    model_dir = _build_mistral(tmp_path / "mistral-window", torch.float32, sliding_window=4)
    prompt = [5, 77, 300, 2, 499, 18, 64, 9, 120, 33, 7]
    ours = _logits(model_dir, "float32", prompt)
    ref = hf_prompt_logits(model_dir, prompt)[-1]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    full = _logits(_build_mistral(tmp_path / "mistral-full", torch.float32), "float32", prompt)
    assert not torch.allclose(ours, full, atol=1e-3), "the window was meant to matter"


def test_llama_attention_bias_covers_o_proj(tmp_path: Path) -> None:
    """HF Llama's ``attention_bias`` biases q, k, v *and* o (Qwen2's only q, k, v)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=503,
        max_position_embeddings=128,
        attention_bias=True,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)  # transformers initialises biases to zero
    model.save_pretrained(tmp_path / "llama")
    prompt = [5, 77, 300, 2, 499, 18, 64, 9]
    ours = _logits(tmp_path / "llama", "float32", prompt)
    ref = hf_prompt_logits(tmp_path / "llama", prompt)[-1]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_sliding_windows_served_or_refused_by_family() -> None:
    """Mistral's and Qwen2's windows are served (their KV groups); a family whose windows
    are not (Mixtral) refuses one that would matter, naming the length that serves it."""
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "max_position_embeddings": 256,
    }
    mistral = ModelConfig.from_dict(
        {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    )
    OurLlama.check_config(mistral, 128)
    assert layer_windows(mistral) == (64, 64)
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    off = ModelConfig.from_dict({**qwen2, "use_sliding_window": False})
    assert layer_windows(off) == (None, None)
    on = ModelConfig.from_dict({**qwen2, "use_sliding_window": True, "max_window_layers": 1})
    assert layer_windows(on) == (None, 32)
    mixtral = ModelConfig.from_dict(
        {**base, "architectures": ["MixtralForCausalLM"], "sliding_window": 64}
    )
    with pytest.raises(ValueError, match=r"sliding_window 64 .*--max-model-len 64"):
        check_no_window(mixtral, 128)
    check_no_window(mixtral, 64)  # every sequence fits the window: exact
