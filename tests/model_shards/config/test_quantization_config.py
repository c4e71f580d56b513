"""``quantization_config``: the served schemes read into ``CheckpointQuant``, every other one a
``ValueError`` naming the field and its value (before any process: ``ReplicaConfig.validate``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model_shards.config.quantization import (
    CheckpointQuant,
    parse_kv_cache_scheme,
    parse_quantization_config,
)
from model_shards.config.replica import ReplicaConfig
from tests.model_shards.quant_checkpoints import SPECS
from tests.server.conftest import write_tiny_model_config

SERVED = {
    "awq": CheckpointQuant("awq", "awq", 32, symmetric=False),
    "gptq": CheckpointQuant("gptq", "gptq", 32, zeros_minus_one=True),
    "gptq-actorder": CheckpointQuant("gptq", "gptq", 16, False, desc_act=True),
    "ct-w4a16": CheckpointQuant("ct-int4", "compressed-tensors", 32),
    "ct-w4a16-asym": CheckpointQuant("ct-int4", "compressed-tensors", 32, symmetric=False),
    "ct-fp8-dynamic": CheckpointQuant("fp8", "compressed-tensors"),
    "ct-fp8-static": CheckpointQuant("fp8", "compressed-tensors", static_input=True),
    "fbgemm-fp8": CheckpointQuant("fp8", "fbgemm_fp8", input_scale_ub=1200.0),
}


@pytest.mark.parametrize("name", list(SERVED))
def test_served_schemes(name: str) -> None:
    raw = {"quantization_config": SPECS[name].config}
    assert parse_quantization_config(raw, "config.json") == SERVED[name]
    assert parse_quantization_config({}, "config.json") is None


def _ct(fmt: str, weights: dict[str, Any], inputs: dict[str, Any] | None) -> dict[str, Any]:
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": scheme}}


FP8_W = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
INT4_W = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
    ({"quant_method": "bitsandbytes"}, "quant_method = 'bitsandbytes'"),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": -1}, "activation_scale_ub = -1"),
    ({**AWQ, "version": "gemv"}, "version = 'gemv'"),
    ({**AWQ, "bits": 8}, "bits = 8"),
    ({**AWQ, "zero_point": False}, "zero_point = False"),
    ({**GPTQ, "bits": 3}, "bits = 3"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format = 'marlin'"),
    ({**GPTQ, "is_marlin_format": True}, "is_marlin_format"),
    ({**GPTQ, "lm_head": True}, "lm_head"),
    ({**GPTQ, "group_size": 0}, "group_size = 0"),
    (_ct("float-quantized", {**FP8_W, "strategy": "block"}, TOKENS), "weights.strategy = 'block'"),
    (_ct("float-quantized", FP8_W, None), "input_activations"),
    (_ct("float-quantized", FP8_W, {**TOKENS, "strategy": "group"}), "strategy = 'group'"),
    (_ct("pack-quantized", {**INT4_W, "num_bits": 8}, None), "num_bits = 8"),
    (_ct("pack-quantized", {**INT4_W, "actorder": "group"}, None), "actorder = 'group'"),
    (_ct("pack-quantized", {**INT4_W, "strategy": "channel"}, None), "strategy = 'channel'"),
    (_ct("pack-quantized", INT4_W, TOKENS), "input_activations"),
    (_ct("int-quantized", INT4_W, None), "format = 'int-quantized'"),
    (
        {**_ct("pack-quantized", INT4_W, None), "sparsity_config": {"format": "sparse-24"}},
        "sparsity_config.format = 'sparse-24'",
    ),
    ({**_ct("pack-quantized", INT4_W, None), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache"),
    (
        _ct("float-quantized", FP8_W, {**TOKENS, "symmetric": False}),
        "input_activations.symmetric = False",
    ),
    (
        {**_ct("pack-quantized", INT4_W, None), "transform_config": {"config_groups": {}}},
        "transform_config",
    ),
]
KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
KV_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({**KV_FP8, "symmetric": False}, "kv_cache_scheme.symmetric = False"),
    ({**KV_FP8, "strategy": "attn_head"}, "kv_cache_scheme.strategy = 'attn_head'"),
    ({**KV_FP8, "strategy": "channel"}, "kv_cache_scheme.strategy = 'channel'"),
    ({**KV_FP8, "dynamic": True}, "kv_cache_scheme.dynamic = True"),
    ({**KV_FP8, "type": "int"}, "kv_cache_scheme.type = 'int'"),
    ({**KV_FP8, "num_bits": 4}, "kv_cache_scheme.num_bits = 4"),
]


def test_kv_cache_scheme_served() -> None:
    """FP8 per-tensor K/V scales: beside FP8 weights, or alone (dense weights)."""
    fp8 = {**_ct("float-quantized", FP8_W, TOKENS), "kv_cache_scheme": KV_FP8}
    raw = {"quantization_config": fp8}
    assert parse_quantization_config(raw, "c") == CheckpointQuant("fp8", "compressed-tensors")
    assert parse_kv_cache_scheme(raw, "c")
    alone = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": KV_FP8}
    assert parse_quantization_config({"quantization_config": alone}, "c") is None
    assert parse_kv_cache_scheme({"quantization_config": alone}, "c")
    assert not parse_kv_cache_scheme({"quantization_config": AWQ}, "c")
    assert not parse_kv_cache_scheme({}, "c")


@pytest.mark.parametrize(("scheme", "field"), KV_REFUSED, ids=[f for _, f in KV_REFUSED])
def test_kv_cache_scheme_refused_names_the_field(scheme: dict[str, Any], field: str) -> None:
    for weights in ({"config_groups": {}}, _ct("float-quantized", FP8_W, TOKENS)):
        qc = {"quant_method": "compressed-tensors", **weights, "kv_cache_scheme": scheme}
        raw = {"quantization_config": qc}
        for parse in (parse_quantization_config, parse_kv_cache_scheme):
            with pytest.raises(ValueError, match="quantization_config") as info:
                parse(raw, "x/config.json")
            assert field in str(info.value), str(info.value)
    with pytest.raises(ValueError, match=r"kv_cache_scheme = .* compressed-tensors"):
        parse_kv_cache_scheme({"quantization_config": {**AWQ, "kv_cache_scheme": KV_FP8}}, "x")


@pytest.mark.parametrize(("config", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_refused_schemes_name_the_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match="quantization_config") as info:
        parse_quantization_config({"quantization_config": config}, "x/config.json")
    assert field in str(info.value) and "x/config.json" in str(info.value)


def test_replica_validation_refuses_before_spawn(tmp_path: Path) -> None:
    write_tiny_model_config(tmp_path, vocab_size=400)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "quantization_config": REFUSED[0][0]}))
    with pytest.raises(ValueError, match="weight_block_size"):
        ReplicaConfig(str(tmp_path)).validate()
    path.write_text(json.dumps({**config, "quantization_config": AWQ}))
    assert ReplicaConfig(str(tmp_path)).validate().quant == CheckpointQuant(
        "awq", "awq", 128, False
    )
    with pytest.raises(ValueError, match="--quantization fp8: the checkpoint is already"):
        ReplicaConfig(str(tmp_path), quantization="fp8").validate()


def test_tp_that_cuts_a_group_is_refused_before_spawn(tmp_path: Path) -> None:
    """4-bit groups of 32: -tp 4 splits the 64 attention-output inputs into 16 per rank."""
    write_tiny_model_config(tmp_path, vocab_size=400)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "quantization_config": {**AWQ, "group_size": 32}}))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4: the attention output") as info:
        ReplicaConfig(str(tmp_path), tp=4).validate()
    assert "quantization_config.group_size" in str(info.value)
    assert "sizes that can: [1, 2]" in str(info.value)
    assert ReplicaConfig(str(tmp_path), tp=2).validate().quant is not None
    act_order = {**GPTQ, "group_size": 32, "desc_act": True}  # every rank keeps every group
    path.write_text(json.dumps({**config, "quantization_config": act_order}))
    assert ReplicaConfig(str(tmp_path), tp=4).validate().quant is not None
