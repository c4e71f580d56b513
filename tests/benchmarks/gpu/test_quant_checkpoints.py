"""The gpu-check's quantized and dequantized checkpoints, written at tiny size on CPU and read
back through the server's own config parser and loaders.

- ``quant_checkpoints``, run as the check runs it (a subprocess that waits for the dense
  build), on the smoke shape: FP8 and AWQ read back by ``QuantizedStore`` within round to
  nearest of the dense weights; the stored bytes bar the embedding equal
  ``quant_runs.decode_bytes_per_token`` (the roofline's weights); a rerun is cached.
- ``smollm2_dense`` on a tiny llama GGUF: every tensor equal to transformers' own GGUF
  loading of the file; the config and tokenizer the server reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.gpu import build_model, check, quant_checkpoints, quant_runs, smollm2_dense
from benchmarks.gpu.phases import Run
from benchmarks.gpu.settings import Budget
from benchmarks.gpu.shapes import LLAMA3_8B, SMOKE
from benchmarks.harness.quantize_checkpoint import LINEARS
from model_shards.config.model import ModelConfig
from model_shards.config.quantization import CheckpointQuant
from model_shards.gguf.tokenizer import tokenizer_from_gguf
from model_shards.worker.checkpoint import Checkpoint
from model_shards.worker.quant_sources import QuantizedStore
from tests.model_shards.gguf.tiny import build, hf_reference

GROUP = quant_runs.SMOKE_GROUP_SIZE
EXPECTED = {
    "fp8": CheckpointQuant("fp8", "compressed-tensors"),
    "awq": CheckpointQuant("awq", "awq", GROUP, symmetric=False),
}


def _within_rounding(got: torch.Tensor, w: torch.Tensor, fmt: str) -> bool:
    wf = w.float()
    if fmt == "fp8":  # e4m3: within 2^-4 of |w|, or the subnormal step of its channel
        step = wf.abs().amax(1, keepdim=True) / 448 * 2.0**-9
        bound = torch.maximum(wf.abs() * 2.0**-4, step)
    else:  # half a step of its group (the float16 scale's rounding aside)
        g = wf.view(wf.shape[0], -1, GROUP)
        span = g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0)  # [N, K/G]
        bound = (span / 15 * 0.51 + 1e-3 * span.max()).repeat_interleave(GROUP, dim=1)
    return bool(((got - wf).abs() <= bound).all())


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], Run]:
    """The smoke-shape dense checkpoint and the check's quantizer's outputs of it."""
    work = tmp_path_factory.mktemp("gpu-check")
    args = ["--smoke", "--work-dir", str(work), "--model-cache", str(work / "llama")]
    settings = check.settings_from(check.parse_args(args))
    run = Run(settings, Budget(300.0, reserve_s=0.0), results={"missing": {}, "notes": []})
    proc = quant_runs.start_build(run)  # before the dense build: it waits for it
    build_model.ensure(settings.model_dir, SMOKE, "cpu", "bfloat16")
    return settings.model_dir, quant_runs.finish_build(run, proc), run


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", quant_runs.FORMATS)
def test_quantized_checkpoint_reads_back(
    quantized: tuple[Path, dict[str, Path], Run], fmt: str
) -> None:
    dense, built, run = quantized
    assert run.results["missing"] == {} and set(built) == set(quant_runs.FORMATS)
    out = built[fmt]
    assert out == quant_checkpoints.quant_dir(dense, dense.parent, fmt)
    assert run.results["quant"]["build"][fmt]["cached"] is False
    cfg = ModelConfig.from_dir(out)
    assert cfg.quant == EXPECTED[fmt]
    weights = {k: v for f in dense.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    with Checkpoint(out) as checkpoint:
        store = QuantizedStore(checkpoint, cfg.quant)
        assert set(store.names()) == set(weights)
        for name, w in weights.items():
            got = store.source(name).read()
            if name.removesuffix(".weight").rpartition(".")[2] in LINEARS:
                assert _within_rounding(got, w, fmt), name
            else:
                assert torch.equal(got, w), name
    stored = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    index = json.loads((out / build_model.INDEX).read_text())["weight_map"]
    assert set(index) == set(stored)
    read = sum(t.numel() * t.element_size() for k, t in stored.items() if "embed_tokens" not in k)
    assert read == quant_runs.decode_bytes_per_token(SMOKE, fmt, GROUP, "bfloat16", 0)
    again = quant_checkpoints.ensure(dense, dense.parent, fmt, GROUP, "cpu")
    assert again["cached"] is True


def test_decode_bytes_at_8b() -> None:
    bf16 = LLAMA3_8B.decode_bytes_per_token("bfloat16", 192)
    fp8 = quant_runs.decode_bytes_per_token(LLAMA3_8B, "fp8", 128, "bfloat16", 192)
    awq = quant_runs.decode_bytes_per_token(LLAMA3_8B, "awq", 128, "bfloat16", 192)
    linears = 32 * sum(n * k for n, k in quant_runs.linear_shapes(LLAMA3_8B))
    head_norms_kv = bf16 - 2 * linears
    assert fp8 == pytest.approx(linears + head_norms_kv, rel=1e-3)  # + scales, 0.03 %
    assert awq == pytest.approx(linears * (0.5 + 2.5 / 128) + head_norms_kv)
    assert (bf16 / fp8, bf16 / awq) == (pytest.approx(1.87, abs=0.01), pytest.approx(3.2, abs=0.05))
    with pytest.raises(ValueError, match="gptq"):
        quant_runs.stored_linear_bytes(8, 128, "gptq", 128)


def test_wait_for_a_dense_build(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="no complete checkpoint"):
        quant_checkpoints.wait_for(tmp_path, SMOKE, "bfloat16", 0.0)


@pytest.mark.timeout(120)
def test_smollm2_dense_equals_transformers_gguf_reading(tmp_path: Path) -> None:
    gguf = build("llama", tmp_path)  # K-quants, Q8_0, Q4_x: every q/k row un-permuted
    out = smollm2_dense.ensure(gguf, tmp_path / "dense", "float32")
    assert out["cached"] is False
    dense = Path(out["dir"])
    got = load_file(str(dense / "model.safetensors"))
    want = hf_reference(gguf, "llama").state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    cfg = ModelConfig.from_dir(dense)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
    tokenizer, _ = tokenizer_from_gguf(gguf)
    saved = json.loads((dense / "tokenizer.json").read_text())
    assert saved == json.loads(tokenizer.to_str())
    assert smollm2_dense.ensure(gguf, dense, "float32")["cached"] is True
