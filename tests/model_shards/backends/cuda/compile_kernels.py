"""Compile (never run) the Triton kernels of quantized weights, FP8 K/V pools, sparse MoE,
LoRA, RoPE and the fused gate/up, without a GPU: all for sm90, the FP8 ones for sm80 (which
has no e4m3 type). Run as ``python -m tests.model_shards.backends.cuda.compile_kernels`` with
``TRITON_INTERPRET=0`` (:mod:`.test_triton_compile` does). Triton's interpreter accepts what a
compiled kernel refuses (non-constexpr globals, returns of unlike types, FP8 types an
architecture lacks); this lowers each kernel to a cubin with the ``ptxas`` in Triton's wheel.
Prints one line per kernel and target; exit status 1 if any failed.
"""

from __future__ import annotations

import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model_shards.backends.cuda.triton_ops import (
    attention_decode,
    attention_prefill,
    fp8_gemm,
    fused_moe,
    gate_up,
    int4_gemm,
    lora,
    rotary,
)

FLOATS = {"qk_scale", "cap2", "k_scale", "v_scale", "eps"}  # scalar float arguments; others int32


def compile_one(fn: Any, ptrs: dict[str, str], constexprs: dict[str, Any], arch: int) -> str:
    """``""`` if ``fn`` compiles for ``sm{arch}``, else the error's last lines."""
    signature = {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = ptrs.get(p.name, "*fp32")
        else:
            signature[p.name] = "fp32" if p.name in FLOATS else "i32"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        triton.compile(source, target=GPUTarget("cuda", arch, 32))
    except Exception as exc:  # every failure is reported, none raised
        cause: BaseException | None = exc
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        return f"{type(cause).__name__}: {str(cause)[-400:]}"
    return ""


def cases(arch: int) -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """(name, kernel, pointer types, constexprs) of every kernel to compile for ``arch``."""
    pool = "*u8"  # FP8 pools reach the kernels as their bytes
    att = {"q_ptr": "*bf16", "k_ptr": pool, "v_ptr": pool, "bt_ptr": "*i64", "ctx_ptr": "*i64"}
    att |= {"out_ptr": "*bf16", "q_starts_ptr": "*i64", "q_lens_ptr": "*i64", "starts_ptr": "*i64"}
    tiles = dict(BLOCK_SIZE=16, BLOCK_N=64, BLOCK_D=128, F32_DOT=False, HAS_CAP=False, KV_FP8=True)
    rope = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "k_pool_ptr": pool, "v_pool_ptr": pool}
    rope |= {"slot_ptr": "*i64", "qw_ptr": "*bf16", "kw_ptr": "*bf16"}
    int4 = {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8"}
    int4 |= {"gidx_ptr": "*i64", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    lora_ptrs = {"slots_ptr": "*i64"} | {f"{n}_ptr": "*bf16" for n in ("x", "a", "v", "b", "y")}
    found: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = [
        ("decode", attention_decode._decode_kernel, att, tiles | dict(BLOCK_G=16)),
        ("decode split", attention_decode._decode_split_kernel, att, tiles | dict(BLOCK_G=16)),
        ("prefill", attention_prefill._prefill_kernel, att, tiles | dict(BLOCK_M=64)),
        ("rotary", rotary._rotary_cache_kernel, rope, dict(NUM_HEADS=32, NUM_KV_HEADS=8,
         HEAD_DIM=128, BLOCK_HALF=64, BLOCK_D=128, KV_FP8=True, HAS_NORM=False)),
        ("rotary q/k norm", rotary._rotary_cache_kernel, rope, dict(NUM_HEADS=32, NUM_KV_HEADS=8,
         HEAD_DIM=128, BLOCK_HALF=64, BLOCK_D=128, KV_FP8=False, HAS_NORM=True)),
        ("fp8 quantize", fp8_gemm._quant_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*u8"},
         dict(K=4096, STATIC=False, FP8_MAX=448.0, BLOCK=1024)),
        ("int4 reduce", int4_gemm._reduce_kernel, {"b_ptr": "*bf16", "y_ptr": "*bf16"},
         dict(PARTS=8, HAS_BIAS=True, BLOCK=256)),
        ("gate_up silu", gate_up._gate_up_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16",
         "y_ptr": "*bf16"}, dict(K=4096, INTER=14336, PRECISION="tf32", UPCAST=False,
         BLOCK_M=16, BLOCK_N=32, BLOCK_K=128)),
        ("lora shrink", lora._shrink_kernel, lora_ptrs, dict(BLOCK_R=16, BLOCK_K=64)),
        ("lora expand", lora._expand_kernel, lora_ptrs, dict(BLOCK_R=16, BLOCK_N=64)),
    ]  # fmt: skip
    for operand in ("fp8", "bf16") if arch >= 89 else ("bf16",):
        t = "*fp8e4nv" if operand == "fp8" else "*u8"
        ptrs = {"xq_ptr": t, "w_ptr": t, "b_ptr": "*bf16", "y_ptr": "*bf16"}
        ce = dict(K=4096, HAS_BIAS=True, OPERAND=operand, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)
        found.append((f"fp8 gemm {operand}", fp8_gemm._fp8_gemm_kernel, ptrs, ce))
    if arch < 89:  # below FP8 tensor cores: what differs there, the FP8 paths on bytes
        return [case for case in found if "int4" not in case[0] and case[0] != "decode split"]
    for split, gidx in ((True, False), (False, True)):
        ce = dict(K=4096, PARTITION=512, GROUP=128, HAS_ZEROS=True, HAS_GIDX=gidx)
        ce |= dict(GROUP_ALIGNED=not gidx, HAS_BIAS=True, SPLIT=split, UPCAST=False)
        ce |= dict(PRECISION="tf32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
        found.append((f"int4 split={split} g_idx={gidx}", int4_gemm._int4_kernel, int4, ce))
    return found + moe_cases()


def moe_cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The sparse MoE kernels (:mod:`fused_moe`) on bfloat16 at a Mixtral shape."""
    blocks = {"pairs_ptr": "*i64", "block_expert_ptr": "*i64"}
    gemm = dict(PRECISION="tf32", UPCAST=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    shape = dict(HIDDEN=4096, INTER=14336)
    gate_up = blocks | {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16"}
    down = blocks | {"h_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"}
    combine = {"y_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64"}
    combine |= {"slot_order_ptr": "*i64", "out_ptr": "*bf16"}
    return [
        ("moe gate_up", fused_moe._gate_up_kernel, gate_up, gemm | shape | dict(TOP_K=2)),
        ("moe down", fused_moe._down_kernel, down, gemm | shape),
        ("moe combine", fused_moe._combine_kernel, combine,
         dict(TOP_K=2, HIDDEN=4096, BLOCK_H=1024)),
    ]  # fmt: skip


def main() -> int:
    failed = 0
    for arch in (90, 80):
        for name, fn, ptrs, constexprs in cases(arch):
            error = compile_one(fn, ptrs, constexprs, arch)
            failed += bool(error)
            print(f"{'FAIL' if error else 'ok'} sm{arch} {name} {error}".rstrip(), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
