"""Strict loading and sliced reads, in one process (tp = pp = 1 and simulated TP ranks)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_shards.backends import ReferenceBackend
from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.models.llama import LlamaForCausalLM
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.checkpoint import Checkpoint, CheckpointError
from model_shards.worker.loader import load_weights
from tests.checkpoints import build_tiny_qwen2


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("load") / "qwen2")


def _edited(src: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    for name, value in edit.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, dst / "model.safetensors")
    return dst


def _load(model_dir: Path) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM(cfg, ShardContext.single_process(ReferenceBackend()), 64)
    with Checkpoint(model_dir) as ck:
        load_weights(model, ck)
    return model


def test_loads_and_ties_head(qwen_dir: Path) -> None:
    model = _load(qwen_dir)
    assert model.lm_head is not None and model.model.embed_tokens is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = load_file(qwen_dir / "model.safetensors")
    q = ref["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[: q.shape[0]], q)


def test_unknown_tensor_is_an_error(qwen_dir: Path, tmp_path: Path) -> None:
    bad = _edited(qwen_dir, tmp_path / "m", {"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected .*model\.layers\.0\.mlp\.extra\.weight"):
        _load(bad)


def test_missing_tensor_is_an_error(qwen_dir: Path, tmp_path: Path) -> None:
    bad = _edited(qwen_dir, tmp_path / "m", {"model.layers.5.mlp.up_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.5\.mlp\.up_proj\.weight"):
        _load(bad)


def test_wrong_shape_is_an_error(qwen_dir: Path, tmp_path: Path) -> None:
    bad = _edited(qwen_dir, tmp_path / "m", {"model.norm.weight": torch.ones(63)})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        _load(bad)


def test_integer_dtype_is_an_error(qwen_dir: Path, tmp_path: Path) -> None:
    bad = _edited(
        qwen_dir, tmp_path / "m", {"model.norm.weight": torch.ones(64, dtype=torch.int32)}
    )
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*int32"):
        _load(bad)


def test_bfloat16_checkpoint_into_float32(qwen_dir: Path, tmp_path: Path) -> None:
    tensors = {k: v.bfloat16() for k, v in load_file(qwen_dir / "model.safetensors").items()}
    bf = _edited(qwen_dir, tmp_path / "bf16", tensors)
    model = _load(bf)
    assert model.model.norm is not None
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"].float())


def test_sliced_reads_match_full_tensor(qwen_dir: Path) -> None:
    ref = load_file(qwen_dir / "model.safetensors")
    with Checkpoint(qwen_dir) as ck:
        name = "model.layers.1.mlp.down_proj.weight"
        src = ck.source(name)
        assert torch.equal(src.read(1, 32, 64), ref[name][:, 32:64])
        assert torch.equal(src.read(0, 10, 20), ref[name][10:20])
        assert ck.bytes_read == (64 * 32 + 10 * 128) * 4


def test_tp_shards_reassemble_the_full_weights(qwen_dir: Path) -> None:
    """Simulated TP ranks (no process group needed to load) hold disjoint slices that tile W."""
    cfg = ModelConfig.from_dir(qwen_dir)
    ref = load_file(qwen_dir / "model.safetensors")
    tp = 4  # 2 KV heads: each replicated on two ranks
    shards = []
    for rank in range(tp):
        ps = replace(single_process_state(), tp_rank=rank, tp_size=tp)
        ctx = ShardContext(Comm(ps), ReferenceBackend(), torch.float32)
        model = LlamaForCausalLM(cfg, ctx, 64)
        with Checkpoint(qwen_dir) as ck:
            load_weights(model, ck)
        shards.append(model)
    down = torch.cat([m.model.layers[2].mlp.down_proj.weight for m in shards], dim=1)
    assert torch.equal(down, ref["model.layers.2.mlp.down_proj.weight"])
    k_ref = ref["model.layers.0.self_attn.k_proj.weight"]  # [2 heads * 16, 64]
    for rank, m in enumerate(shards):
        qkv = m.model.layers[0].self_attn.qkv_proj.weight  # q: 1 head, k: 1 head, v: 1 head
        assert torch.equal(qkv[16:32], k_ref[(rank // 2) * 16 : (rank // 2 + 1) * 16])
    emb = torch.cat([m.model.embed_tokens.weight for m in shards if m.model.embed_tokens])
    assert torch.equal(emb[: cfg.vocab_size], ref["model.embed_tokens.weight"])
    assert not emb[cfg.vocab_size :].any(), "vocab padding rows must be zero"
