"""The CUDA backend's fused kernels against their unfused launches, on the checkpoint's
shapes (issue 43 item 2): the step breakdown's ``{"event": "fusions", "rows": [...]}``.

Each row times both forms with CUDA events (mean of ``reps`` after a warm-up) and says
whether the fused output equals the unfused one bit for bit (else the largest difference):

- ``add_norm``: the last stage's ``x + residual``, then RMSNorm → one fused add + RMSNorm
  (``LayerStack.finish``; bitwise by contract);
- ``qk_norm_rope``: per-head q/k RMSNorms (a norm launch and a copy each for q and k) then
  RoPE + K/V write → one launch (Qwen3's layout on this model's heads; the norm weights are
  drawn, the 8B has none); bitwise by contract;
- ``gate_up_silu``: ``F.linear`` (cuBLAS) then SiLU-and-mul → the Triton GEMM with
  SiLU-and-mul in its epilogue (``SHARDSERVE_FUSED_GATE_UP=1``, off until this row shows
  it faster); another summation order, so not bitwise: the difference is reported. 16-bit
  only: a float32 run measures it in bfloat16.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.plain_llama import PlainConfig

Timer = Callable[[Callable[[], object], str, int], float]  # (fn, device, reps) → ms
NORM_ROWS = (1, 32)
GATE_UP_ROWS = (1, 16)  # the fused GEMM takes at most 16 rows (gate_up.MAX_ROWS)


def _add_then_norm(
    ops: Any, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float
) -> torch.Tensor:
    return ops.rms_norm(x + r, None, w, eps)[0]


def _norm_then_rope(
    ops: Any, qkv: torch.Tensor, *, heads: tuple[int, int], step: Any, pool: Any, norms: Any
) -> torch.Tensor:
    """The unfused form: the heads normalized (two norm launches, two copies), then RoPE."""
    ops.normalize_heads(qkv, heads, norms)
    return ops.rotary_and_cache(qkv, step, pool, heads)


def _linear_then_silu(ops: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ops.silu_and_mul(F.linear(x, w))


def _row(
    name: str, m: int, unfused: float, fused: float, same: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    a, b = same
    return {
        "fusion": name,
        "m": m,
        "unfused_ms": unfused,
        "fused_ms": fused,
        "saved_us": 1000 * (unfused - fused),
        "bitwise": bool(torch.equal(a, b)),
        "max_abs_diff": float((a.float() - b.float()).abs().max()),
    }


def add_norm_rows(
    cfg: PlainConfig, device: str, dtype: torch.dtype, timer: Timer, reps: int, small: bool
) -> list[dict[str, Any]]:
    from model_shards.backends.cuda.backend import CudaBackend

    ops, rows = CudaBackend(), []
    w = torch.randn(cfg.hidden, device=device, dtype=dtype)
    for m in NORM_ROWS[:1] if small else NORM_ROWS:
        x = torch.randn(m, cfg.hidden, device=device, dtype=dtype)
        r = torch.randn(m, cfg.hidden, device=device, dtype=dtype)
        want = ops.rms_norm(x + r, None, w, cfg.eps)[0]
        got = ops.rms_norm(x, r.clone(), w, cfg.eps)[0]
        unfused = timer(partial(_add_then_norm, ops, x, r, w, cfg.eps), device, reps)
        scratch = r.clone()  # the fused form adds into its residual: it grows, the time not
        fused = timer(partial(ops.rms_norm, x, scratch, w, cfg.eps), device, reps)
        rows.append(_row("add_norm", m, unfused, fused, (got, want)))
    return rows


def qk_norm_rope_rows(
    cfg: PlainConfig, device: str, dtype: torch.dtype, timer: Timer, reps: int, small: bool
) -> list[dict[str, Any]]:
    from model_shards.backends.base import HeadNorms, KVPool, RotaryStep
    from model_shards.backends.cuda.backend import CudaBackend

    ops, rows, d = CudaBackend(), [], cfg.head_dim
    heads, width = (cfg.heads, cfg.kv_heads), (cfg.heads + 2 * cfg.kv_heads) * d
    norms = HeadNorms(
        1 + 0.1 * torch.randn(d, device=device, dtype=dtype),
        1 + 0.1 * torch.randn(d, device=device, dtype=dtype),
        cfg.eps,
    )
    theta = torch.rand(4096, d, device=device) * 6.0
    for m in NORM_ROWS[:1] if small else NORM_ROWS:
        k, v = (torch.zeros(256, cfg.kv_heads, d, device=device, dtype=dtype) for _ in "kv")
        pool = KVPool(k, v, 16)
        positions = torch.arange(m, device=device) + 100
        step = RotaryStep(positions, theta.cos(), theta.sin(), torch.arange(m, device=device))
        qkv = torch.randn(m, width, device=device, dtype=dtype)
        unfused_once = partial(_norm_then_rope, ops, heads=heads, step=step, pool=pool, norms=norms)
        want, got = (
            unfused_once(qkv.clone()),
            ops.rotary_and_cache(qkv.clone(), step, pool, heads, norms),
        )
        buf = qkv.clone()  # normalized and rotated in place, again each run (bounded)
        unfused = timer(partial(unfused_once, buf), device, reps)
        fused = timer(partial(ops.rotary_and_cache, buf, step, pool, heads, norms), device, reps)
        rows.append(_row("qk_norm_rope", m, unfused, fused, (got, want)))
    return rows


def gate_up_rows(
    cfg: PlainConfig, device: str, dtype: torch.dtype, timer: Timer, reps: int, small: bool
) -> list[dict[str, Any]]:
    from model_shards.backends.cuda.backend import CudaBackend
    from model_shards.backends.cuda.triton_ops.gate_up import gate_up_silu

    ops, rows = CudaBackend(fused_gate_up=False), []
    dtype = torch.bfloat16 if dtype == torch.float32 else dtype  # the fused GEMM is 16-bit
    w = torch.randn(2 * cfg.intermediate, cfg.hidden, device=device, dtype=dtype) * 0.02
    for m in GATE_UP_ROWS[:1] if small else GATE_UP_ROWS:
        x = torch.randn(m, cfg.hidden, device=device, dtype=dtype)
        want, got = ops.silu_and_mul(F.linear(x, w)), gate_up_silu(x, w)
        unfused = timer(partial(_linear_then_silu, ops, x, w), device, reps)
        fused = timer(partial(gate_up_silu, x, w), device, reps)
        row = _row("gate_up_silu", m, unfused, fused, (got, want))
        row["gb_s_fused"] = w.numel() * w.element_size() / fused / 1e6
        rows.append(row)
    return rows


def fusion_rows(
    cfg: PlainConfig, device: str, dtype: torch.dtype, timer: Timer, reps: int = 50
) -> dict[str, Any]:
    """The ``fusions`` event: every fusion's rows, or why none was measured. On CPU only in
    Triton's interpreter (``TRITON_INTERPRET=1``: the tests), one row, one run each."""
    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        return {"event": "fusions", "rows": [], "skipped": f"no CUDA device ({device})"}
    reps = reps if on_gpu else 1  # the interpreter: one row count each, one run
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for name, measure in (
        ("add_norm", add_norm_rows),
        ("qk_norm_rope", qk_norm_rope_rows),
        ("gate_up_silu", gate_up_rows),
    ):
        try:
            rows += measure(cfg, device, dtype, timer, reps, not on_gpu)
        except Exception as exc:  # one failing fusion leaves the others' rows
            errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"event": "fusions", "rows": rows, "errors": errors}
