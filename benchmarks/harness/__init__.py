"""What every benchmark uses; imports no suite, micro-benchmark or GPU-check module.

- ``paths``: the repository, ``benchmarks/.cache`` and ``benchmarks/results``.
- ``model``: the random ~135M Llama bench checkpoint (three variants), built once.
- ``prompts``: exact-length text prompts and their JSONL datasets.
- ``servers``: start a server subprocess, wait for it, always stop its process group.
- ``http_load``: one closed-loop load point through ``deploy/loadtest.py``.
- ``hf_generate``: padded-batch ``generate()``, the hf-generate system (a subprocess).
- ``bench``: one run's settings, datasets, rows and notes, and the servers the suites start.
- ``tables``: rows keyed by point, the median of repeated runs, shared table cells.
- ``quiesce``: wait until the servers are idle before each point.
- ``neighbours``: busy-loop neighbour processes and stopping a session.
- ``machine``: the CPU, cores and versions, and the roofline run in a subprocess.
- ``roofline``: this machine's matmul and memory-bandwidth ceilings.
"""
