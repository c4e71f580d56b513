"""Tensor-parallel building blocks that the model families compose. Sharding is declared on
each parameter (``weight_loader``); every op is the backend's.

- ``context``: ``ShardContext``, what every layer is built with (comm, backend, dtype)
- ``linear``: replicated, column-, merged-column-, QKV- and row-parallel linears
- ``loading``: how loaders fill a parameter: dense, or held quantized (GGUF, ``--quantization``)
- ``checkpoint_quant``: weights held as AWQ / GPTQ / compressed-tensors / FP8 store them; GEMM
- ``fused_sources``: column-parallel linears read from one fused checkpoint tensor (Phi-3)
- ``conv1d``: linears whose checkpoint stores ``W^T`` (GPT-2's ``Conv1D``)
- ``vocab``: vocabulary-parallel embedding and LM head, replicated embedding
- ``norm``: RMSNorm and LayerNorm
- ``sharded_norm``: RMSNorm over a head-split projection, reduced across TP (OLMo 2)
- ``rotary``: RoPE tables (linear, llama3, longrope, yarn; partial rotary)
- ``attention``: ``ForwardBatch`` (a step), ``Attention`` and ``paged_attention`` (decode/prefill)
- ``rotary_attention``: the attention block, q/k/v → q/k norms → RoPE → attention → o
- ``mlp``: the gated MLP, gate/up column-parallel → act-and-mul → down row-parallel
- ``moe``: router, stacked experts, shared expert, expert-parallel dispatch
- ``expert_quant``: a quantized checkpoint's experts, as GGML blocks (cpu) or dequantized at load
- ``lora``: a linear's multi-LoRA adapter slots (A, B sharded like its weight), per-row adds
"""
