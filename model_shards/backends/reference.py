"""The reference backend: plain PyTorch on any device, the numerical spec of every kernel.

FP8 K/V pools (``float8_e4m3fn``, ``--kv-cache-dtype fp8``): a pool holds
``e4m3(clamp(k / k_scale, ±448))`` (round to nearest even), read back as
``(float32(stored) · k_scale)`` rounded to the query's dtype; the same for v with ``v_scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_shards.backends.base import (
    Backend,
    DecodeMeta,
    ExpertWeights,
    HeadNorms,
    KVPool,
    LoraBatch,
    PrefillMeta,
    RotaryStep,
)
from model_shards.quant.formats import BLOCK_TYPES, GGMLType
from model_shards.quant.fp8 import Fp8Weight, quantize_activations
from model_shards.quant.int4 import Int4GroupWeight
from model_shards.quant.weights import QuantizedWeight
from model_shards.splitmix import FINAL_SHIFT, GOLDEN, MIX_ROUNDS


def _int64(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bit patterns; torch's ``>>`` is arithmetic."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def race_uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``seeds [S]`` int64 → ``[S, vocab]`` float64 uniforms in (0, 1): token ``i``'s is the top
    53 bits of ``splitmix64(seed, i + 1)`` (:mod:`model_shards.splitmix`, in wrapping int64)."""
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    z = seeds[:, None] + counters * _int64(GOLDEN)
    for shift, multiplier in MIX_ROUNDS:
        z = (z ^ _shift_right(z, shift)) * _int64(multiplier)
    z = z ^ _shift_right(z, FINAL_SHIFT)
    return (_shift_right(z, 11).double() + 0.5) * 2.0**-53


FP8_KV = torch.float8_e4m3fn


def to_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as an FP8 pool stores it: ``e4m3(clamp(x / scale, ±448))``."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8_KV)


def from_pool(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Values read from a pool, in ``dtype`` (FP8: ``float32(x) · scale``, then rounded)."""
    return (x.float() * scale).to(dtype) if x.dtype == FP8_KV else x


def write_pool(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """``pool[slots] = x`` (``[n, nkv, D]``), encoded for an FP8 pool (as its bytes: torch has
    no FP8 ``index_copy_`` on CPU)."""
    if pool.dtype == FP8_KV:
        pool.view(torch.uint8).index_copy_(0, slots, to_e4m3(x, scale).view(torch.uint8))
    else:
        pool.index_copy_(0, slots, x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``q: (B, nh, L, D)`` over ``k, v: (B, nkv, S, D)`` (GQA if ``nkv < nh``), boolean ``mask``
    broadcastable to ``(B, nh, L, S)`` (``None``: causal) → ``(B, nh, L, D)``. ``softcap``
    squashes scores to ``softcap * tanh(s / softcap)``, in float32 (transformers' Gemma 2)."""
    nh, nkv = q.shape[1], k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=nh != nkv
        )
    assert mask is not None, "soft-capped attention takes an explicit mask"
    kf = k.float().repeat_interleave(nh // nkv, dim=1)  # (B, nh, S, D)
    vf = v.float().repeat_interleave(nh // nkv, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # (B, nh, L, S)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).to(q.dtype)


def _window_blocks(
    tables: torch.Tensor, lens: torch.Tensor, window: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns of ``tables [B, nblk]`` a sliding window can reach: ``[B, n]`` (``n``
    the most blocks ``window`` positions span) and each row's first position ``[B]``."""
    n = min(tables.shape[1], -(-(window - 1) // block_size) + 1)
    first_block = ((lens - window).clamp(min=0) // block_size).clamp(max=tables.shape[1] - n)
    columns = first_block[:, None] + torch.arange(n, device=tables.device)  # [B, n]
    return tables.gather(1, columns), first_block * block_size


def block_slots(table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``start .. end - 1`` through one block table ``[nblk]``."""
    positions = torch.arange(start, end, device=table.device)
    return table[positions // block_size] * block_size + positions % block_size


class ReferenceBackend(Backend):
    name = "reference"
    fp8_kv = True

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

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoraBatch,
        cols: torch.Tensor | None = None,
    ) -> None:
        groups = batch.groups
        if groups is None:  # a graph's replay: the groups of its rows' slots, found now
            slots = batch.row_slots[: x.shape[0]]
            found = [s for s in slots.unique().tolist() if s >= 0]
            groups = [(s, (slots == s).nonzero().flatten()) for s in found]
        for slot, rows in groups:  # one shrink and one expand per adapter in the step
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a[slot].T) @ b[slot].T  # [t, R] -> [t, out]
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        step: RotaryStep,
        pool: KVPool,
        heads: tuple[int, int],
        norms: HeadNorms | None = None,
    ) -> torch.Tensor:
        if norms is not None:
            self.normalize_heads(qkv, heads, norms)
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
        write_pool(k_pool, slot_mapping, k, pool.k_scale)
        write_pool(v_pool, slot_mapping, v, pool.v_scale)
        return q

    def decode_attention(
        self,
        q: torch.Tensor,
        pool: KVPool,
        meta: DecodeMeta,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """The whole blocks of every row gathered and padded, one masked attention."""
        b, d = q.shape[0], q.shape[2]
        k_pool, v_pool, block_tables, context_lens = (
            pool.k,
            pool.v,
            meta.block_tables,
            meta.context_lens,
        )
        nkv, bs = k_pool.shape[1], pool.block_size
        first = torch.zeros_like(context_lens)  # [B] first position gathered
        if meta.window is not None:
            block_tables, first = _window_blocks(block_tables, context_lens, meta.window, bs)
        blocks = block_tables.reshape(-1)
        # whole blocks: (B * nblk, bs, nkv, D) -> (B, nkv, nblk * bs, D)
        kd = k_pool.view(-1, bs, nkv, d).index_select(0, blocks).view(b, -1, nkv, d)
        vd = v_pool.view(-1, bs, nkv, d).index_select(0, blocks).view(b, -1, nkv, d)
        kd, vd = from_pool(kd, pool.k_scale, q.dtype), from_pool(vd, pool.v_scale, q.dtype)
        qd, kd, vd = q.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2)  # (B, nh, 1, D)
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # single-token queries run ~4x faster in float32 on CPU, conversions included
            qd, kd, vd = qd.float(), kd.float(), vd.float()
        span = torch.arange(kd.shape[2], device=q.device).unsqueeze(0) + first[:, None]  # [B, S]
        lens = context_lens.unsqueeze(1)  # [B, 1]
        mask = span < lens
        if meta.window is not None:
            mask &= span >= lens - meta.window
        od = attend(qd, kd, vd, mask[:, None, None, :], scale, softcap)  # (B, nh, 1, D)
        od = torch.where(context_lens[:, None, None, None] > 0, od, 0.0)  # padding rows
        return od.squeeze(2).to(q.dtype)

    def prefill_attention(
        self,
        q: torch.Tensor,
        pool: KVPool,
        meta: PrefillMeta,
        scale: float,
        out: torch.Tensor,
        softcap: float | None = None,
    ) -> None:
        """One causal attention per chunk over its gathered context."""
        k_pool, v_pool = pool.k, pool.v
        for n in range(meta.num_chunks):
            row, length = meta.q_starts_list[n], meta.q_lens_list[n]
            start = meta.start_positions_list[n]
            slots = block_slots(meta.block_tables[n], 0, start + length, meta.block_size)
            qp = q[row : row + length].transpose(0, 1).unsqueeze(0)  # (1, nh, L, D)
            kp = from_pool(k_pool[slots], pool.k_scale, q.dtype).transpose(0, 1).unsqueeze(0)
            vp = from_pool(v_pool[slots], pool.v_scale, q.dtype).transpose(0, 1).unsqueeze(0)
            # kp, vp: (1, nkv, S + L, D)
            mask = None  # causal from position 0: SDPA's own
            if start > 0 or meta.window is not None or softcap is not None:
                qpos = torch.arange(length, device=q.device).unsqueeze(1) + start  # [L, 1]
                kpos = torch.arange(start + length, device=q.device).unsqueeze(0)  # [1, S+L]
                mask = kpos <= qpos
                if meta.window is not None:
                    mask &= kpos > qpos - meta.window
            op = attend(qp, kp, vp, mask, scale, softcap)  # (1, nh, L, D)
            out[row : row + length] = op[0].transpose(0, 1)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def quantized_types(self) -> frozenset[GGMLType]:
        return BLOCK_TYPES

    def quantized_linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Dequantize, then one float32 GEMM, rounded once to ``x.dtype``."""
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.dequantize(), b).to(x.dtype)

    def quantized_embedding(
        self, ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype
    ) -> torch.Tensor:
        return weight.take_rows(ids).to(dtype)

    def int4_linear(
        self, x: torch.Tensor, weight: Int4GroupWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Dequantize, then one float32 GEMM, rounded once to ``x.dtype``."""
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.dequantize(), b).to(x.dtype)

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The activations rounded to FP8, the weight dequantized, one float32 GEMM."""
        b = None if bias is None else bias.float()
        xq = quantize_activations(x, weight.input_scale, weight.input_scale_ub)
        return F.linear(xq, weight.dequantize(), b).to(x.dtype)

    def fused_moe(
        self,
        x: torch.Tensor,
        experts: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """One expert at a time over the rows routed to it (as Hugging Face's loop)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        for e in range(experts.num_experts):
            rows, slots = (topk_ids == e).nonzero(as_tuple=True)  # [n], [n]
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows], experts.w13[e]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, experts.w2[e])  # [n, H]
            out.index_add_(0, rows, y.float() * topk_weights[rows, slots, None])
        return out.to(x.dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        ratio = -race_uniforms(seeds, probs.shape[-1]).log() / probs.double()
        ratio = torch.where(probs > 0, ratio, torch.inf)
        return ratio.argmin(dim=-1)
