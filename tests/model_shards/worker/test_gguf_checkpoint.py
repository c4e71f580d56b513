"""GGUF tensor sources: every tensor reads as transformers' GGUF loader gives it (names,
un-permuted q/k rows, Gemma's norms, dequantized values), slices read only their rows, and
``read_blocks`` returns the file's bytes at block boundaries or names the valid splits."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model_shards.worker.checkpoint import CheckpointError
from model_shards.worker.gguf_checkpoint import GGUFCheckpoint
from tests.model_shards.gguf.tiny import build, hf_reference

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-ckpt")
    return {arch: build(arch, root) for arch in ("llama", "qwen2", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_every_tensor_reads_as_transformers_loads_it(arch: str, files: dict[str, Path]) -> None:
    reference = hf_reference(files[arch], arch).state_dict()
    with GGUFCheckpoint(files[arch]) as ckpt:
        names = ckpt.names()
        for name in names:
            source = ckpt.source(name)
            assert torch.equal(source.read().float(), reference[name]), name
        stored = {n: ckpt.source(n).dtype for n in names}
    assert set(names) == set(reference) - ({"lm_head.weight"} if arch != "llama" else set())
    if arch == "qwen2":  # float types as stored, quantized ones dequantized
        assert stored["model.layers.0.self_attn.q_proj.weight"] == torch.float16
        assert stored["model.layers.0.self_attn.v_proj.weight"] == torch.bfloat16
        assert stored["model.layers.0.self_attn.k_proj.weight"] == torch.float32


def test_slices_read_only_their_rows(files: dict[str, Path]) -> None:
    with GGUFCheckpoint(files["llama"]) as ckpt:
        q = ckpt.source("model.layers.0.self_attn.q_proj.weight")  # Q4_K, permuted
        down = ckpt.source("model.layers.1.mlp.down_proj.weight")  # Q5_0
        assert (q.ggml_type, down.ggml_type) == (Q.Q4_K, Q.Q5_0)
        full_q, full_down = q.read(), down.read()
        before = ckpt.bytes_read
        assert torch.equal(q.read(0, 64, 192), full_q[64:192])
        assert ckpt.bytes_read - before == 128 * 144, "128 rows of one Q4_K block"
        before = ckpt.bytes_read
        assert torch.equal(down.read(1, 128, 256), full_down[:, 128:256])
        assert ckpt.bytes_read - before == 256 * 4 * 22, "every row's 4 Q5_0 blocks of 8"
        assert torch.equal(down.read(1, 40, 70), full_down[:, 40:70])


def test_read_blocks_returns_the_files_bytes(files: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(files["llama"])
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    with GGUFCheckpoint(files["llama"]) as ckpt:
        down = ckpt.source("model.layers.1.mlp.down_proj.weight")
        blocks = down.read_blocks(3, 9, 64, 160)
        assert blocks.dtype == torch.uint8 and blocks.shape == (6, 3 * 22)
        assert np.array_equal(blocks.numpy(), stored["blk.1.ffn_down.weight"][3:9, 2 * 22 : 5 * 22])
        values = gguf.quants.dequantize(blocks.numpy(), Q.Q5_0)
        assert np.array_equal(values, down.read(0, 3, 9)[:, 64:160].numpy())
        q = ckpt.source("model.layers.0.self_attn.q_proj.weight")
        dequantized = gguf.quants.dequantize(q.read_blocks(64, 128).numpy(), Q.Q4_K)
        assert np.array_equal(dequantized, q.read(0, 64, 128).numpy()), "rows come un-permuted"


def test_read_blocks_refusals_name_the_tensor(files: dict[str, Path]) -> None:
    with GGUFCheckpoint(files["llama"]) as ckpt:
        down = ckpt.source("model.layers.1.mlp.down_proj.weight")
        message = r"down_proj.weight' \(Q5_0, 32 elements per block\): columns 0:80 of 256 "
        with pytest.raises(CheckpointError, match=message + r".*parallel-size \[1, 2, 4, 8\]$"):
            down.read_blocks(0, 4, 0, 80)
        norm = ckpt.source("model.norm.weight")
        with pytest.raises(CheckpointError, match="read_blocks takes 2-D"):
            norm.read_blocks(0, 1)
