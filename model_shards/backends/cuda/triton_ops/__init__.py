"""Triton kernels of the ``cuda`` backend, one module per op family.

* ``attention_decode.py``: paged decode attention with GQA, single pass or split over the context;
* ``attention_prefill.py``: varlen causal prefill attention of a step's chunks, one launch;
* ``rotary.py``: RoPE on q and k fused with the K/V cache write (and per-head q/k RMSNorms);
* ``norm.py``: RMSNorm with the fused residual add;
* ``activation.py``: SiLU-and-mul of the gated MLP;
* ``gate_up.py``: the gate/up GEMM of a decode-sized step with SiLU-and-mul in its epilogue;
* ``sampling.py``: the position-seeded exponential-race draw (splitmix64 uniforms);
* ``gemm.py``: the batch-invariant dense GEMM of ``--batch-invariant``;
* ``int4_gemm.py``: the W4A16 GEMM of 4-bit AWQ/GPTQ weights, split-K for decode;
* ``fused_moe.py``: sparse MoE experts, grouped GEMMs over the routed experts only
  (``moe_align.py``: the pairs sorted and padded per expert into row blocks);
* ``fp8_gemm.py``: FP8 W8A8: per-token activation rounding to e4m3, the FP8 GEMM, ``_scaled_mm``;
* ``e4m3.py``: e4m3 rounding, and the FP8 K/V pools' store and load (``--kv-cache-dtype fp8``);
* ``lora.py``: multi-LoRA shrink and expand, a slot per row read on the device (Punica's BGMV).

Each module's wrapper takes the arguments of the matching
:class:`model_shards.backends.base.Backend` method; the elementwise kernels round exactly as the
reference backend does, and attention reads the paged pool in place (windows, soft-caps
included). Importing needs ``triton`` (it ships with every CUDA build of torch); on CPU the
tests run the kernels in Triton's interpreter (``TRITON_INTERPRET=1``) against the reference.
"""
