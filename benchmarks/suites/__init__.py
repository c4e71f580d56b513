"""What ``make bench`` runs; each suite measures its rows and renders its own table.

- ``throughput``: every concurrency and dtype against both baselines; tp/pp; Qwen3 family.
- ``ttft``: time to first token at concurrency 1, split into its stages.
- ``moe_bench``: a Mixtral-shaped model at tp=1, tp=2 and tp=2 with expert parallelism.
- ``quant_bench``: the bench model as FP8 and AWQ checkpoints beside the dense one (bfloat16).
- ``structured``: json_schema requests against unconstrained ones.
- ``vlm_bench``: images through LLaVA and Qwen2.5-VL, against ``generate()``.
- ``qwen_vl_bench``: the Qwen2.5-VL model, images and ``generate()`` of ``vlm_bench``.
- ``contention``: throughput beside busy neighbours and under a CPU quota, against vLLM-CPU.
- ``contention_table``: the contention conditions and their table.
- ``contention_ab``: settings of ours A/B under the same contention (not in ``make bench``).
- ``llamacpp_peer``: the real SmolLM2 model (GGUF Q4_1, Q8_0, Q4_K_M) beside ``llama-server``.
- ``llamacpp_table``: its table.
- ``spec_decode``: n-gram speculative decoding against none on the real SmolLM2 model (editing
  and chat at concurrency 1, chat at 32), with the acceptance read from ``/metrics``; draft
  models at concurrency 1 (random 2-layer, the target's first 2 layers, the target itself).
- ``spec_draft``: the draft GGUFs ``spec_decode`` serves, written from the target's.
"""
