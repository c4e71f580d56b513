"""``make gpu-check``: parity on the GPU, an 8B-shaped Llama served and measured against
HF ``generate()``, and the report.

- ``check``: the check's flags, pipeline and deadline (``python -m benchmarks gpu-check``).
- ``settings``: what one run does and its time budget.
- ``shapes``: the Llama shapes and the HBM roofline arithmetic.
- ``build_model``: a random Llama checkpoint written from tensors (a subprocess).
- ``parity``: the parity tests on the device, once per dtype.
- ``phases``: the check's phases, each storing what it measured.
- ``procs``: subprocesses in their own sessions, logged, always stoppable.
- ``serve``: our server's command line, start-up timings and load points.
- ``hf_bench``: HF ``generate()`` on the device (a subprocess).
- ``quant_checkpoints``: the 8B-shaped checkpoint as FP8 and AWQ, quantized on the device
  (a subprocess); ``quant_runs``: their servers measured beside bf16, the bytes a decode
  step reads from each; ``quant_report``: those rows and targets.
- ``smollm2_dense``: the packaged SmolLM2 GGUF as a bf16 directory (a subprocess);
  ``perplexity_phase``: its perplexity served in bf16 and with ``--quantization fp8``.
- ``report``: every number with its target, as JSON and markdown.
- ``wheels.sh``: the wheels the offline GPU host lacks.
"""
