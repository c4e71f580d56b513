"""What every benchmark uses; imports no suite, micro-benchmark or GPU-check module.

- ``paths``: the repository, ``benchmarks/.cache`` and ``benchmarks/results``.
- ``model``: the random ~135M Llama bench checkpoint (three variants), built once.
- ``prompts``: exact-length text prompts and their JSONL datasets.
- ``spec_prompts``: the speculative-decoding workloads' prompts (editing, chat).
- ``servers``: start a server subprocess, wait for it, always stop its process group.
- ``http_load``: one closed-loop load point through ``deploy/loadtest.py``.
- ``hf_generate``: padded-batch ``generate()``, the hf-generate system (a subprocess).
- ``bench``: one run's settings, datasets, rows and notes, and the servers the suites start.
- ``tables``: rows keyed by point, the median of repeated runs, shared table cells.
- ``ab_rows``: two kinds on one server compared: alternating rounds, their table, run alone.
- ``quiesce``: wait until the servers are idle before each point.
- ``neighbours``: busy-loop neighbour processes and stopping a session.
- ``machine``: the CPU, cores and versions, and the roofline run in a subprocess.
- ``roofline``: this machine's matmul and memory-bandwidth ceilings.
- ``llamacpp``: llama.cpp's sources (the ``llama-cpp-python`` sdist), its build, ``llama-server``.
- ``gguf_models``: SmolLM2-135M-Instruct as GGUF files (Q4_1, Q8_0, Q4_K_M) and dequantized.
- ``gguf_dequantize``: a GGUF file's weights into a Hugging Face directory (a subprocess).
- ``quantize_checkpoint``: a dense checkpoint's linears as compressed-tensors FP8 or AWQ.
- ``perplexity``: a fixed text's perplexity over HTTP (its windows, their prompt logprobs).
- ``peak_rss``: peak RSS (``VmHWM``) of a server's rank processes.
"""
