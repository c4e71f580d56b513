"""LongRoPE and partial rotary tables against transformers' ``Phi3RotaryEmbedding``: the
short factors below ``original_max_position_embeddings`` and the long ones from there on
(our per-position rule), the attention factor on cos and sin, and a partial rotation
expressed as a whole-head one over :func:`rotary_head_order`'s dims."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from model_shards.backends.reference import rotate_half
from model_shards.config.model import ModelConfig
from model_shards.layers.rotary import RotaryEmbedding, rotary_head_order
from tests.families import phi3

ORIGINAL = phi3.ORIGINAL_MAX_POSITIONS
POSITIONS = 3 * ORIGINAL  # past the original maximum: both factor sets in one table


def _ours(factor: float) -> RotaryEmbedding:
    hf_config = phi3.config(rope_parameters=phi3.longrope(factor))
    cfg = ModelConfig.from_dict(hf_config.to_dict() | {"architectures": ["Phi3ForCausalLM"]})
    return RotaryEmbedding(cfg.head_dim, POSITIONS, cfg.rope, int(cfg.head_dim * factor))


def _hf(factor: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin ``[seq_len, R]`` for one sequence of ``seq_len`` tokens
    (long factors when ``seq_len`` exceeds the original maximum)."""
    rope = Phi3RotaryEmbedding(phi3.config(rope_parameters=phi3.longrope(factor)))
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rope(x, torch.arange(seq_len)[None])
    return cos[0], sin[0]


def _rotated_columns(table: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Our ``[P, D]`` table's columns of the rotated dims, in transformers' ``[P, R]`` order."""
    half, r = table.shape[1] // 2, rotary_dim // 2
    return torch.cat((table[:, :r], table[:, half : half + r]), dim=1)


@pytest.mark.parametrize("factor", [1.0, phi3.PARTIAL_ROTARY_FACTOR])
def test_tables_equal_transformers_for_both_factor_sets(factor: float) -> None:
    ours = _ours(factor)
    rotary_dim = int(phi3.HEAD_DIM * factor)
    short_cos, short_sin = _hf(factor, ORIGINAL)  # a sequence of the original length: short
    long_cos, long_sin = _hf(factor, POSITIONS)  # a longer one: long factors everywhere
    cos = _rotated_columns(ours.cos_cached, rotary_dim)
    sin = _rotated_columns(ours.sin_cached, rotary_dim)
    torch.testing.assert_close(cos[:ORIGINAL], short_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin[:ORIGINAL], short_sin, rtol=0, atol=0)
    torch.testing.assert_close(cos[ORIGINAL:], long_cos[ORIGINAL:], rtol=0, atol=0)
    torch.testing.assert_close(sin[ORIGINAL:], long_sin[ORIGINAL:], rtol=0, atol=0)
    assert not torch.equal(short_cos, long_cos[:ORIGINAL])  # the two sets differ
    # position 0: cos 0 = 1 times the attention factor sqrt(1 + ln(256 / 64) / ln 64)
    assert cos[0, 0].item() == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))


def test_pass_through_dims_do_not_turn() -> None:
    ours = _ours(phi3.PARTIAL_ROTARY_FACTOR)
    half, r = phi3.HEAD_DIM // 2, int(phi3.HEAD_DIM * phi3.PARTIAL_ROTARY_FACTOR) // 2
    for start in (r, half + r):
        assert torch.equal(ours.cos_cached[:, start : start + half - r], torch.ones(POSITIONS, 2))
        assert torch.equal(ours.sin_cached[:, start : start + half - r], torch.zeros(POSITIONS, 2))


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 12), (16, 16), (96, 72), (10, 4)])
def test_whole_head_rotation_in_rotary_order_is_the_partial_rotation(
    head_dim: int, rotary_dim: int
) -> None:
    """``q . k`` survives the same permutation of both; so rotating the permuted head with
    our tables must give transformers' partial rotation, permuted."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, head_dim, generator=gen)  # [T, heads, D]
    angles = torch.rand(5, rotary_dim // 2, generator=gen) * 6
    cos_r, sin_r = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want, _ = apply_rotary_pos_emb(q, q, cos_r, sin_r, unsqueeze_dim=1)  # [T, heads, D]
    rest = torch.zeros(5, (head_dim - rotary_dim) // 2)
    half_cos = torch.cat((angles.cos(), rest.cos()), -1)
    half_sin = torch.cat((angles.sin(), rest.sin()), -1)
    cos = torch.cat((half_cos, half_cos), -1)[:, None]  # [T, 1, D], as our tables
    sin = torch.cat((half_sin, half_sin), -1)[:, None]
    order = rotary_head_order(head_dim, rotary_dim)
    stored = q[..., order]
    got = stored * cos + rotate_half(stored) * sin
    torch.testing.assert_close(got, want[..., order])


def test_odd_rotary_split_and_wrong_factor_count_are_refused() -> None:
    with pytest.raises(ValueError, match="both parts must be even"):
        rotary_head_order(16, 11)
    fields: dict[str, Any] = phi3.config().to_dict() | {"architectures": ["Phi3ForCausalLM"]}
    fields["rope_parameters"] = phi3.longrope(1.0) | {"short_factor": [1.0] * 5}
    cfg = ModelConfig.from_dict(fields)
    with pytest.raises(ValueError, match="short_factor has 5 entries, expected 8"):
        RotaryEmbedding(cfg.head_dim, 32, cfg.rope)
