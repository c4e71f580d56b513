"""A checkpoint's FP8 KV-cache scales (compressed-tensors ``kv_cache_scheme``,
``model_shards/worker/kv_scales.py``) served by the reference backend (the spec the Triton
kernels are tested against: ``tests/model_shards/backends/cuda/test_triton_kv_fp8.py``).

The tiny Llama with dense weights, a ``kv_cache_scheme`` and per-layer scales (three layers'
``k_scale``/``v_scale``, one layer's older single ``kv_scale``), served with ``--kv-cache-dtype
auto``: every pool is e4m3 with its layer's scales; the cached bytes are ``e4m3(x / scale)`` of
the K/V transformers computes (all but a few one-step rounding flips of float rounding); logits
and greedy tokens match transformers whose cache rounds K/V the same way. Scales it cannot serve
are refused naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model_shards.backends import ReferenceBackend
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import SeqChunk
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.checkpoint import CheckpointError
from model_shards.worker.decoder_worker import Worker
from model_shards.worker.kv_scales import kv_pool_dtype
from tests.checkpoints import build_tiny_llama, load_hf_model
from tests.logits import prompt_logits, record_logits
from tests.model_shards.models.parity_harness import MAX_LEN, PROMPTS, generate_greedy

FP8 = torch.float8_e4m3fn
NEW_TOKENS = 12
# max|k|, max|v| of this model are ~5: layer 0's K scale clamps some values at ±448
_SCALES = {0: (0.008, 0.02), 1: (0.015, 0.011), 2: (0.02, 0.025), 3: (0.012, 0.012)}
SCALES = {i: (float(torch.tensor(k)), float(torch.tensor(v))) for i, (k, v) in _SCALES.items()}
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
KV_SCHEME |= {"symmetric": True}


def _e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(FP8)


def write_kv_scaled(dense: Path, out: Path, scales: dict[int, tuple[float, float]]) -> Path:
    """``dense`` with a ``kv_cache_scheme`` and ``scales`` (layer 3: one ``kv_scale``)."""
    shutil.copytree(dense, out)
    tensors = load_file(str(dense / "model.safetensors"))
    for layer, (k, v) in scales.items():
        prefix = f"model.layers.{layer}.self_attn"
        if layer == 3:
            assert k == v
            tensors[f"{prefix}.kv_scale"] = torch.tensor(k)
            continue
        tensors[f"{prefix}.k_scale"] = torch.tensor([k])
        tensors[f"{prefix}.v_scale"] = torch.tensor(v)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    qc: dict[str, Any] = {"quant_method": "compressed-tensors", "config_groups": {}}
    qc |= {"kv_cache_scheme": KV_SCHEME, "format": "dense"}
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return out


class RoundingCache(transformers.DynamicCache):
    """transformers' cache with K/V rounded as an FP8 pool holds them (``e4m3(x / s) · s``);
    the unrounded K/V of the last call kept in ``seen`` by layer."""

    def __init__(self, config: transformers.PretrainedConfig) -> None:
        super().__init__(config=config)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(  # type: ignore[override]
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen[layer_idx] = (key, value)  # [1, nkv, S, D]
        ks, vs = SCALES[layer_idx]
        key, value = _e4m3(key, ks).float() * ks, _e4m3(value, vs).float() * vs
        return super().update(key, value, layer_idx, *args, **kw)


def reference(model: transformers.PreTrainedModel, prompt: list[int]) -> tuple[Any, ...]:
    """Prompt logits, greedy tokens (full recompute each step) and the last call's K/V."""
    ids, first, cache = list(prompt), None, None
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            cache = RoundingCache(model.config)
            logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    assert cache is not None
    return first, ids[len(prompt) :], cache.seen


def _build(path: Path) -> Worker:
    replica = ReplicaConfig(str(path), dtype="float32", max_num_seqs=4, block_size=4)
    cfg = replica.validate()
    assert isinstance(cfg, ModelConfig)
    comm = Comm(single_process_state())
    return Worker.build(replica, cfg, comm, MAX_LEN, ops=ReferenceBackend())


@pytest.mark.timeout(120)
def test_checkpoint_kv_scales_fill_an_fp8_cache(tmp_path: Path) -> None:
    dense = build_tiny_llama(tmp_path / "dense", sharded=False)
    served = write_kv_scaled(dense, tmp_path / "kv", SCALES)
    worker = _build(served)
    pools = worker.kv.pools
    assert {i: (p.k_scale, p.v_scale) for i, p in pools.items()} == SCALES
    assert all(p.k.dtype == FP8 and p.v.dtype == FP8 for p in pools.values())

    tables: dict[int, list[int]] = {}
    extend = worker.kv.extend_tables

    def record(chunks: list[SeqChunk]) -> None:
        extend(chunks)
        tables.update({c.seq_id: list(worker.kv.tables[c.seq_id]) for c in chunks})

    worker.kv.extend_tables = record  # type: ignore[method-assign]
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN)
    logits = prompt_logits(coord, recorder, PROMPTS)
    tokens = generate_greedy(coord, PROMPTS, NEW_TOKENS)
    model = load_hf_model(dense)
    for i, prompt in enumerate(PROMPTS):
        ref_logits, ref_tokens, _ = reference(model, prompt)
        rel = ((logits[i] - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert rel < 1e-4, f"prompt {i}: logits relative error {rel:.2e}"
        assert tokens[str(i)] == ref_tokens, f"prompt {i}"

    # the generation of prompt 0 (the second to last sequence): its cached bytes
    _, _, seen = reference(model, PROMPTS[0])
    table, bs = tables[sorted(tables)[-2]], worker.kv.block_size
    length = len(PROMPTS[0]) + NEW_TOKENS - 1  # the last token is sampled, never cached
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
    for layer, (k_scale, v_scale) in SCALES.items():
        for pool, x, scale in ((pools[layer].k, seen[layer][0], k_scale),
                               (pools[layer].v, seen[layer][1], v_scale)):  # fmt: skip
            ours = pool[slots].view(torch.uint8).int()  # [S, nkv, D]
            want = _e4m3(x[0].transpose(0, 1), scale).view(torch.uint8).int()
            differ = ours != want
            assert differ.float().mean() < 2e-3, f"layer {layer}: {int(differ.sum())} bytes"
            assert bool(((ours - want)[differ].abs() == 1).all()), f"layer {layer}: not a flip"


def test_kv_scales_it_cannot_serve_are_refused(tmp_path: Path) -> None:
    """Per-head scales, a non-positive one and a layer without any: errors naming the tensor."""
    dense = build_tiny_llama(tmp_path / "dense", sharded=False)
    served = write_kv_scaled(dense, tmp_path / "kv", SCALES)
    tensors = load_file(str(served / "model.safetensors"))
    cases = {
        "model.layers.1.self_attn.k_scale": torch.full((2,), 0.01),  # one per KV head
        "model.layers.2.self_attn.v_scale": torch.tensor(0.0),
    }
    for name, value in cases.items():
        save_file({**tensors, name: value}, str(served / "model.safetensors"))
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            _build(served)
    missing = {n: t for n, t in tensors.items() if ".layers.0.self_attn.k_scale" not in n}
    save_file(missing, str(served / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.v_scale"):
        _build(served)
    no_scales = {n: t for n, t in tensors.items() if not n.endswith("scale")}
    save_file(no_scales, str(served / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layer 0: no k_scale/v_scale tensors.*_scheme"):
        _build(served)


def test_auto_kv_dtype_follows_the_scheme_where_served(tmp_path: Path) -> None:
    """``--kv-cache-dtype auto`` with a ``kv_cache_scheme``: FP8 on a backend holding FP8 pools,
    the model's dtype on the ``cpu`` backend and with latent attention (scales unused)."""
    dense = build_tiny_llama(tmp_path / "dense", sharded=False)
    cfg = ModelConfig.from_dir(write_kv_scaled(dense, tmp_path / "kv", SCALES))
    auto = ReplicaConfig("unused")
    cpu = object.__new__(CpuBackend)  # its class attributes only: no C++ build needed
    assert cfg.kv_fp8_scales and not ModelConfig.from_dir(dense).kv_fp8_scales
    assert kv_pool_dtype(auto, torch.bfloat16, ReferenceBackend(), cfg) == FP8
    assert kv_pool_dtype(auto, torch.bfloat16, cpu, cfg) == torch.bfloat16
    latent = dataclasses.replace(cfg, kv_latent=True)
    assert kv_pool_dtype(auto, torch.bfloat16, ReferenceBackend(), latent) == torch.bfloat16
    dense_cfg = ModelConfig.from_dir(dense)
    assert kv_pool_dtype(auto, torch.float32, ReferenceBackend(), dense_cfg) == torch.float32
