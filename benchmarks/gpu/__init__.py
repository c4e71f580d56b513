"""``make gpu-check``: tests on the GPU, an 8B-shaped Llama's step explained, a compiled
plain-PyTorch ceiling, the server measured against it and HF ``generate()``, the report.

- ``check``: the check's flags, pipeline and deadline (``python -m benchmarks gpu-check``).
- ``settings``: what one run does and its time budget (each phase's slot within 8 minutes).
- ``shapes``: the Llama shapes and the HBM roofline arithmetic.
- ``build_model``: a random Llama checkpoint written from tensors (a subprocess).
- ``parity``: the tests on the device: the backends, the models in bf16, tp=2 on one GPU.
- ``graph_parity``: each family on the device vs the reference backend; graphs vs eager.
- ``step_breakdown``: copy bandwidth, ``F.linear`` table, engine step vs graph replay, kernels
  (``fusions``: each fused kernel against its unfused launches).
- ``plain_llama``: a plain PyTorch Llama over a static KV cache (the ceiling's model).
- ``ceiling``: that model under ``torch.compile(mode="reduce-overhead")``, decode tok/s.
- ``phases_device``: the phases running those three scripts as subprocesses.
- ``phases``: the check's phases, each storing what it measured.
- ``procs``: subprocesses in their own sessions, logged, always stoppable.
- ``serve``: our server's command line, start-up timings and load points.
- ``hf_bench``: HF ``generate()`` on the device (a subprocess).
- ``quant_checkpoints``: the 8B-shaped checkpoint as FP8 and AWQ, quantized on the device
  (a subprocess); ``quant_runs``: their servers measured beside bf16, the bytes a decode
  step reads from each; ``quant_report``: those rows and targets.
- ``smollm2_dense``: the packaged SmolLM2 GGUF as a bf16 directory (a subprocess);
  ``perplexity_phase``: its perplexity served in bf16 and with ``--quantization fp8``.
- ``report``: every number with its target, as JSON and markdown (``report_values``: a
  number or why it is missing; ``report_step``: the device rows and tables).
- ``wheels.sh``: the wheels the offline GPU host lacks.
"""
