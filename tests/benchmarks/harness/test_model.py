"""The bench model's arithmetic, without building it."""

from __future__ import annotations

from benchmarks.harness.model import SHAPES


def test_shapes_have_smollm_135m_size() -> None:
    for shape in SHAPES.values():
        qk_norms = 2 * shape.head_dim * shape.layers if shape.qk_norm else 0  # Qwen3's
        assert shape.total_params() == 134_515_008 + qk_norms  # SmolLM-135M's count
        assert shape.matmul_params() == 134_479_872
    # Decode alone is 2 FLOPs per matmul weight; prefill and attention come on top.
    assert SHAPES["main"].flops_per_output_token(32, 64) > 2 * 134_479_872
