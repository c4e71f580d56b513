"""Start-up validation: bad layouts and checkpoints fail before any process, naming the flag."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.launch.replicas import validate_replica
from model_shards.models.stages import stage_layer_range
from tests.checkpoints import build_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("cfg") / "llama", sharded=True)


def test_reads_transformers_config(llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 1001)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0
    assert not cfg.tie_word_embeddings


def test_tp_not_dividing_heads_lists_valid_sizes(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 .*valid sizes: \[1, 2, 4\]"):
        ReplicaConfig(str(llama_dir), tp=3).validate()


def test_pp_larger_than_layers(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 9 exceeds .* 4 layers"):
        ReplicaConfig(str(llama_dir), pp=9).validate()


def test_bad_dtype_and_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--dtype"):
        ReplicaConfig(str(tmp_path), dtype="int3").validate()
    with pytest.raises(ValueError, match=r"--model .*config\.json"):
        ReplicaConfig(str(tmp_path)).validate()


def test_cuda_without_enough_devices(llama_dir: Path) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 4:
        pytest.skip("this machine has 4 GPUs")
    with pytest.raises(ValueError, match="--device cuda needs one GPU per rank"):
        validate_replica(ReplicaConfig(str(llama_dir), tp=4, device="cuda"))


def test_missing_shard_file(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    (broken / sorted(set(index["weight_map"].values()))[0]).unlink()
    with pytest.raises(ValueError, match="shard files missing"):
        validate_replica(ReplicaConfig(str(broken)))


def test_corrupt_safetensors_header(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "corrupt"
    shutil.copytree(llama_dir, broken)
    shard = next(broken.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json!!!!"
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        validate_replica(ReplicaConfig(str(broken)))


def test_truncated_safetensors(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "truncated"
    shutil.copytree(llama_dir, broken)
    shard = next(broken.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="inconsistent with shape"):
        validate_replica(ReplicaConfig(str(broken)))


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (6, 4, [(0, 2), (2, 4), (4, 5), (5, 6)]),
        (4, 2, [(0, 2), (2, 4)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
        (5, 1, [(0, 5)]),
    ],
)
def test_even_stage_ranges_cover_every_layer_once(
    llama_dir: Path, layers: int, pp: int, expected: list[tuple[int, int]]
) -> None:
    cfg = replace(ModelConfig.from_dir(llama_dir), num_layers=layers)
    counts = cfg.layer_partition(pp)
    assert [stage_layer_range(counts, r) for r in range(pp)] == expected


def test_balanced_partition_gives_the_lm_head_stage_fewer_layers(llama_dir: Path) -> None:
    # The benchmark's 135M shape: the 49152 x 576 LM head costs as much as 5.3 layers
    # (8 layers' parameters, but one efficient GEMM against a layer's 1.5 times its GEMMs).
    cfg = replace(
        ModelConfig.from_dir(llama_dir),
        num_layers=30,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
    )
    assert cfg.layer_partition(2, "balanced") == [18, 12]
    assert cfg.layer_partition(2, "19,11") == [19, 11]
    assert cfg.layer_partition(2) == [15, 15]
    many = cfg.layer_partition(30, "balanced")  # never an empty stage
    assert many == [1] * 30


@pytest.mark.parametrize("spec", ["3,1,0", "2,1", "a,b", "", "uneven"])
def test_bad_layer_partition_names_the_flag(llama_dir: Path, spec: str) -> None:
    with pytest.raises(ValueError, match="--pp-layer-partition"):
        validate_replica(ReplicaConfig(str(llama_dir), pp=2, pp_layer_partition=spec))
