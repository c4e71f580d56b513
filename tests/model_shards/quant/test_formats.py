"""GGML formats: our torch (de)quantizers against ``gguf.quants`` (llama.cpp's reference),
bit for bit, on random blocks and edge values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from model_shards.quant.dequantize import dequantize
from model_shards.quant.formats import BLOCK_SIZES, GGMLType, row_bytes
from model_shards.quant.quantize import quantize
from model_shards.quant.weights import QuantizedTensor, QuantizedWeight

ALL = sorted(BLOCK_SIZES)


def _random_blocks(qtype: GGMLType, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """Random bytes with every float16 scale finite (a NaN's payload is not a value)."""
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        dtype = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}.get(qtype, np.float32)
        values = gen.standard_normal((rows, cols)).astype(dtype)
        if qtype == GGMLType.BF16:
            return gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
        return values.view(np.uint8)
    data = gen.integers(0, 256, (rows, row_bytes(qtype, cols)), dtype=np.uint8)
    nbytes = BLOCK_SIZES[qtype][1]
    blocks = data.reshape(-1, nbytes)
    # the float16 scales' offsets in each block
    offsets = {GGMLType.Q6_K: (208,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_1: (0, 2)}
    offsets |= {GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2)}
    scales = gen.standard_normal((blocks.shape[0], 1)).astype(np.float16)
    edge = np.array([[0.0], [-0.0], [65504.0]], dtype=np.float16)  # edge scales
    scales[:3] = edge[: len(scales[:3])]
    for off in offsets.get(qtype, (0,)):
        blocks[:, off : off + 2] = scales.view(np.uint8)
    return data


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_block_table_matches_gguf(qtype: GGMLType) -> None:
    assert BLOCK_SIZES[qtype] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dequantize_is_gguf_bit_for_bit(qtype: GGMLType) -> None:
    gen = np.random.default_rng(int(qtype))
    rows, cols = 5, 512
    data = _random_blocks(qtype, rows, cols, gen)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols)
    got = dequantize(torch.from_numpy(data), qtype, cols)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0], ids=lambda t: t.name)
def test_quantize_is_gguf_bit_for_bit(qtype: GGMLType) -> None:
    gen = np.random.default_rng(7)
    x = (gen.standard_normal((16, 256)) * gen.uniform(1e-3, 10, (16, 1))).astype(np.float32)
    x[0] = 0.0  # a zero block: d = 0
    x[1, :32] = np.linspace(-1, 1, 32)  # exact halves after scaling
    x[2, :32] = 1.0  # equal magnitudes: the first one is the max
    x[2, 32:64] = -1.0
    x[3, 5] = -x[3, :32].__abs__().max()  # a tie in magnitude, negative first
    x[4, :32] = 65504.0  # float16's largest scale
    x[5, :32] = 1e-7  # a scale that rounds to a float16 subnormal
    expected = gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype))
    got = quantize(torch.from_numpy(x), qtype)
    np.testing.assert_array_equal(got.numpy(), expected)
    bf16 = torch.from_numpy(x).bfloat16()  # a bfloat16 checkpoint is quantized as float32
    np.testing.assert_array_equal(
        quantize(bf16, qtype).numpy(),
        gguf.quants.quantize(bf16.float().numpy(), gguf.GGMLQuantizationType(qtype)),
    )


def test_quantized_weight_segments_merge_mix_and_pad() -> None:
    gen = np.random.default_rng(3)
    q4k = torch.from_numpy(_random_blocks(GGMLType.Q4_K, 6, 256, gen))
    q6k = torch.from_numpy(_random_blocks(GGMLType.Q6_K, 2, 256, gen))
    w = QuantizedWeight(out_features=12, in_features=256)
    w.add(0, QuantizedTensor(GGMLType.Q4_K, q4k[:4], 256))
    w.add(4, QuantizedTensor(GGMLType.Q4_K, q4k[4:], 256))  # adjacent, same type: merged
    w.add(6, QuantizedTensor(GGMLType.Q6_K, q6k, 256))
    assert [(s.start, s.end, s.tensor.qtype) for s in w.segments] == [
        (0, 6, GGMLType.Q4_K),
        (6, 8, GGMLType.Q6_K),
    ]
    assert not w.covers_all and w.nbytes == 6 * 144 + 2 * 210
    dense = w.dequantize()
    assert torch.equal(dense[:6], dequantize(q4k, GGMLType.Q4_K, 256))
    assert torch.equal(dense[6:8], dequantize(q6k, GGMLType.Q6_K, 256))
    assert not dense[8:].any()  # uncovered rows are zero
    ids = torch.tensor([7, 0, 11, 5])
    assert torch.equal(w.take_rows(ids), dense[ids])
    with pytest.raises(ValueError, match="loaded twice"):
        w.add(5, QuantizedTensor(GGMLType.Q6_K, q6k[:1], 256))
    with pytest.raises(ValueError, match="do not fit"):
        w.add(11, QuantizedTensor(GGMLType.Q6_K, q6k, 256))

    # parts out of order (a GGUF file lists attn_k, attn_q, attn_v): still one segment
    qkv = QuantizedWeight(out_features=6, in_features=256)
    for start, end in ((2, 4), (0, 2), (4, 6)):
        qkv.add(start, QuantizedTensor(GGMLType.Q4_K, q4k[start:end], 256))
    assert [(s.start, s.end) for s in qkv.segments] == [(0, 6)]
    assert torch.equal(qkv.segments[0].tensor.data, q4k)


def test_quantization_flag_choices_are_the_quantizers() -> None:
    from model_shards.config.replica import QUANTIZATION_CHOICES
    from model_shards.quant.formats import QUANTIZATION_METHODS
    from model_shards.quant.quantize import QUANTIZERS

    assert set(QUANTIZATION_CHOICES) == set(QUANTIZATION_METHODS) | {"fp8"}
    assert set(QUANTIZATION_METHODS.values()) == set(QUANTIZERS)
