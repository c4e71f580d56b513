"""C++ sources of the ``cpu`` backend's kernels, the ops of ``torch.ops.shardserve_cpu``: built
and loaded by ``backends/cpu/build.py``, called by ``backends/cpu/backend.py``.

* ``cpu_ops.cpp``: RMSNorm (+ residual), RoPE + K/V cache write, SiLU-and-mul, row argmax;
  it holds the library's ``TORCH_LIBRARY`` (the other sources add fragments);
* ``decode_attention.cpp``: paged decode attention (argument checks, the portable kernel);
* ``decode_attention_avx512.cpp``: the vectorized decode attention (AVX-512, vdpbf16ps in bf16);
* ``prefill_attention.cpp``: paged causal prefill attention of a step's chunks (GQA, windows,
  a prefix-cached start; argument checks, the portable kernel);
* ``prefill_attention_avx512.cpp``: its vectorized kernel (AVX-512, vdpbf16ps in bf16);
* ``prefill_attention.h``: what the two prefill sources share (operands, tasks);
* ``sampling_ops.cpp``: the exponential-race draw of sampling (splitmix64-hashed uniforms);
* ``gemm.cpp``: the float32 and bfloat16 GEMM over packed weight panels (its AVX-512 tiles;
  ``gemm_isa`` says which tiles run);
* ``gemm_avx2.h``: the GEMM's AVX2 + FMA tiles, for CPUs without AVX-512;
* ``quant_gemm.cpp``: the GEMM of GGML block-quantized weights (Q4_0 … Q8_0, Q4_K/Q5_K/Q6_K)
  with per-block int8 activations;
* ``quant_dot.h``: its activation blocks, block decoding and portable dot products;
* ``quant_dot_avx2.h``: AVX2 int8 dot products (vpdpbusd where VNNI is built), block unpacking;
* ``quant_panel_avx2.h``, ``quant_panel_k_avx2.h``: eight weight rows per pass (32-value
  types, K-quants);
* ``quant_panel_avx512.h``: the 32-value types' panels with AVX-512 BW/VL/VNNI (two rows per
  vpdpbusd, the next rows prefetched), picked over the AVX2 ones where built;
* ``quant_act.h``: rows of x quantized to activation blocks (both quantized GEMMs' first step);
* ``quant_panels.cpp``: the same GEMM over weights laid out as row panels
  (``model_shards/quant/panels.py``), the same bits; built with AVX-512 VNNI only
  (``quant_panels_isa``), and there the backend lays every quantized weight out so;
* ``quant_panels_avx512.h``: its sixteen-row tiles (one row per int32 lane, no reductions);
* ``decode_stack.cpp``: a decode step through a plain decoder stack's layers in one call
  (``torch.classes.shardserve_cpu.DecodeStack``: the kernels above, in the modules' order);
* ``lora.cpp``: multi-LoRA's per-row shrink and expand of a linear layer in one call, over
  ``b`` stored by rank and skipping the zero blocks of a fused layer (AVX-512 or plain loops);
* ``ops.h``: the ops as C++ functions, for kernels that call kernels (``decode_stack.cpp``);
* ``kernel_common.h``: what the others share (decode-attention operands, index checks,
  float32 <-> bfloat16 conversions, the exp polynomial); not needed by ``sampling_ops.cpp``.

Each op computes every row on its own in a fixed order, so no output depends on the batch.
torch re-builds when a source or a flag changes, not a header: ``build.py`` puts a hash of the
headers into the flags.
"""
