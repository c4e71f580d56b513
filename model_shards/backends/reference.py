"""The reference backend: every op as plain PyTorch, the numerical specification the
fused CPU kernels and the Triton kernels are tested against. Runs on any device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_shards.backends.base import Backend, DecodeMeta, KVPool, PrefillMeta, RotaryStep
from model_shards.splitmix import FINAL_SHIFT, GOLDEN, MIX_ROUNDS


def _int64(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bit patterns; torch's ``>>`` is arithmetic."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def race_uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``seeds [S]`` int64 → ``[S, vocab]`` float64 uniforms in (0, 1): token ``i``'s is
    ``splitmix64(seed, i + 1)`` (:mod:`model_shards.splitmix`, here in wrapping int64
    arithmetic), its top 53 bits."""
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    z = seeds[:, None] + counters * _int64(GOLDEN)
    for shift, multiplier in MIX_ROUNDS:
        z = (z ^ _shift_right(z, shift)) * _int64(multiplier)
    z = z ^ _shift_right(z, FINAL_SHIFT)
    return (_shift_right(z, 11).double() + 0.5) * 2.0**-53


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def block_slots(table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``start .. end - 1`` through one block table ``[nblk]``."""
    positions = torch.arange(start, end, device=table.device)
    return table[positions // block_size] * block_size + positions % block_size


class ReferenceBackend(Backend):
    name = "reference"

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = x if residual is None else x + residual
        s32 = s.float()
        s32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * s32.to(s.dtype), s

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_and_cache(
        self, qkv: torch.Tensor, step: RotaryStep, pool: KVPool, heads: tuple[int, int]
    ) -> torch.Tensor:
        num_heads, num_kv_heads = heads
        positions, slot_mapping = step.positions, step.slot_mapping
        cos_cached, sin_cached, k_pool, v_pool = step.cos_cached, step.sin_cached, pool.k, pool.v
        t, d = qkv.shape[0], k_pool.shape[-1]
        q, k, v = qkv.view(t, -1, d).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        cos = cos_cached[positions].unsqueeze(1).to(qkv.dtype)  # [T, 1, D]
        sin = sin_cached[positions].unsqueeze(1).to(qkv.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        real = slot_mapping >= 0
        if not bool(real.all()):
            slot_mapping, k, v = slot_mapping[real], k[real], v[real]
        k_pool.index_copy_(0, slot_mapping, k)
        v_pool.index_copy_(0, slot_mapping, v)
        return q

    def decode_attention(
        self, q: torch.Tensor, pool: KVPool, meta: DecodeMeta, scale: float
    ) -> torch.Tensor:
        """The whole blocks of every row gathered and padded, one masked SDPA."""
        b, nh, d = q.shape
        k_pool, v_pool, block_tables, context_lens = (
            pool.k,
            pool.v,
            meta.block_tables,
            meta.context_lens,
        )
        nkv, bs = k_pool.shape[1], pool.block_size
        blocks = block_tables.reshape(-1)
        # whole blocks: (B * nblk, bs, nkv, D) -> (B, nkv, nblk * bs, D)
        kd = k_pool.view(-1, bs, nkv, d).index_select(0, blocks).view(b, -1, nkv, d)
        vd = v_pool.view(-1, bs, nkv, d).index_select(0, blocks).view(b, -1, nkv, d)
        qd, kd, vd = q.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2)  # (B, nh, 1, D)
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # CPU attention kernels run single-token queries ~4x slower in 16-bit
            # than in float32, conversions included
            qd, kd, vd = qd.float(), kd.float(), vd.float()
        span = torch.arange(kd.shape[2], device=q.device)
        mask = (span.unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :]
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=nh != nkv
        )  # (B, nh, 1, D)
        od = torch.where(context_lens[:, None, None, None] > 0, od, 0.0)  # padding rows
        return od.squeeze(2).to(q.dtype)

    def prefill_attention(
        self, q: torch.Tensor, pool: KVPool, meta: PrefillMeta, scale: float, out: torch.Tensor
    ) -> None:
        """One causal SDPA per chunk over its gathered context."""
        k_pool, v_pool = pool.k, pool.v
        nh, nkv = q.shape[1], k_pool.shape[1]
        for n in range(meta.num_chunks):
            row, length = meta.q_starts_list[n], meta.q_lens_list[n]
            start = meta.start_positions_list[n]
            slots = block_slots(meta.block_tables[n], 0, start + length, meta.block_size)
            qp = q[row : row + length].transpose(0, 1).unsqueeze(0)  # (1, nh, L, D)
            kp = k_pool[slots].transpose(0, 1).unsqueeze(0)  # (1, nkv, S + L, D)
            vp = v_pool[slots].transpose(0, 1).unsqueeze(0)
            mask = None
            if start > 0:
                qpos = torch.arange(length, device=q.device).unsqueeze(1) + start
                mask = torch.arange(start + length, device=q.device).unsqueeze(0) <= qpos
            op = F.scaled_dot_product_attention(
                qp,
                kp,
                vp,
                attn_mask=mask,
                is_causal=start == 0,
                scale=scale,
                enable_gqa=nh != nkv,
            )  # (1, nh, L, D)
            out[row : row + length] = op[0].transpose(0, 1)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        ratio = -race_uniforms(seeds, probs.shape[-1]).log() / probs.double()
        ratio = torch.where(probs > 0, ratio, torch.inf)
        return ratio.argmin(dim=-1)
