"""shardserve's benchmarks; one entry point, ``python -m benchmarks`` (:mod:`benchmarks.__main__`).

- ``harness/``: servers, load, prompts, the bench model, machine facts, shared table cells;
  imports no suite.
- ``suites/``: what ``make bench`` runs, each suite with its own table.
- ``micro/``: kernel and engine-step micro-benchmarks (not part of ``make bench``).
- ``gpu/``: ``make gpu-check``, the GPU path measured on one GPU.
- ``make_bench.py``: ``make bench`` (every suite, then the results and the README).
- ``readme.py``: ``README.md`` from ``README.template.md`` and every suite's table.
"""
