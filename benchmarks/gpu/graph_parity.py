"""Every decoder family on the device at tp=1: the device's backend against the reference
backend, and its decode graphs against its eager steps.

Run as ``python -m benchmarks gpu graph_parity SPEC.json`` (``{"device", "dtype",
"work_dir", "families": [names] (default: all)}``). For each family's tiny random
checkpoint (the tests' builders: Llama and Qwen2 from ``tests/checkpoints.py``, the rest
from ``tests/families/``), three workers serve the same prompts: the reference backend,
the device backend eager (``enforce_eager``), the device backend with its decode graphs,
and with piecewise graphs for mixed steps as well. Prints one JSON line per family::

    {"event": "family", "name", "logits_rel_err", "tokens_equal_reference", "graphed",
     "graph_tokens_equal_eager", "piecewise", "piecewise_tokens_equal_eager", "seconds"}

``logits_rel_err``: the largest over the prompts of max |ours − reference| / max |reference|
of the last prompt position's logits (in ``dtype``: bfloat16 rounds, so greedy tokens may
part from the reference's, which ``tokens_equal_reference`` reports, not asserts); greedy
tokens with graphs must equal the eager ones (the same kernels; padded rows change a GEMM's
M, which may move a last bit, rarely a token). A family that fails
prints ``{"event": "family", "name", "error"}`` and the next one runs.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model_shards.backends import Backend, ReferenceBackend
from model_shards.worker.piecewise_graphs import PIECEWISE_ENV

PROMPTS = [[3, 17, 250, 96, 42, 7, 51, 64, 100], [5, 6]]
NEW_TOKENS = 12
MAX_LEN = 64


def builders() -> dict[str, Callable[[Path], Path]]:
    """Family name → its tiny checkpoint builder (``build(path) -> path``)."""
    from tests.checkpoints import build_tiny_llama, build_tiny_qwen2
    from tests.families import families

    out: dict[str, Callable[[Path], Path]] = {
        "llama": lambda p: build_tiny_llama(p, sharded=False),
        "qwen2": build_tiny_qwen2,
    }
    out.update({f.NAME: f.build for f in families()})
    return out


def serve(
    model_dir: Path, device: str, dtype: str, ops: Backend | None, eager: bool, pieces: bool = False
) -> tuple[list[torch.Tensor], dict[str, list[int]], bool]:
    """Last-position prompt logits, greedy tokens (the prompts staggered: mixed steps),
    whether graphed;
    ``pieces``: mixed steps through piecewise graphs too (``SHARDSERVE_PIECEWISE_GRAPHS``)."""
    from model_shards.config.model import ModelConfig
    from model_shards.config.replica import ReplicaConfig
    from model_shards.engine.coordinator import Coordinator
    from model_shards.messages import GenerateRequest, SamplingParams
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import single_process_state
    from model_shards.worker.decoder_worker import Worker
    from tests.logits import prompt_logits, record_logits

    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype=dtype, max_num_seqs=4, enforce_eager=eager)
    comm = Comm(single_process_state(torch.device(device)))
    os.environ[PIECEWISE_ENV] = "1" if pieces else "0"
    worker = Worker.build(replica, cfg, comm, MAX_LEN, ops=ops)
    graphed = worker.graphs is not None and (not pieces or worker.piecewise is not None)
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=MAX_LEN)
    logits = [row.float().cpu() for row in prompt_logits(coord, recorder, PROMPTS)]
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):  # the second prefills beside the first's decode
        params = SamplingParams(0.0)
        coord.add_request(GenerateRequest(str(i), prompt, NEW_TOKENS, params, ignore_eos=True))
        while coord.has_work() and (i == len(PROMPTS) - 1 or not tokens[str(i)]):
            for update in coord.step():
                tokens[update.output.request_id] += update.output.new_token_ids
    return logits, tokens, graphed


def check_family(model_dir: Path, device: str, dtype: str) -> dict[str, Any]:
    ref_logits, ref_tokens, _ = serve(model_dir, device, dtype, ReferenceBackend(), True)
    logits, tokens, _ = serve(model_dir, device, dtype, None, True)
    _, graph_tokens, graphed = serve(model_dir, device, dtype, None, False)
    _, piece_tokens, pieced = serve(model_dir, device, dtype, None, False, pieces=True)
    errors = [
        ((ours - ref).abs().max() / ref.abs().max()).item()
        for ours, ref in zip(logits, ref_logits, strict=True)
    ]
    return {
        "logits_rel_err": max(errors),
        "tokens_equal_reference": tokens == ref_tokens,
        "graphed": graphed,
        "graph_tokens_equal_eager": graph_tokens == tokens,
        "piecewise": pieced,
        "piecewise_tokens_equal_eager": piece_tokens == tokens,
    }


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    work = Path(spec["work_dir"])
    wanted = spec.get("families")
    for name, build in builders().items():
        if wanted and name not in wanted:
            continue
        start = time.perf_counter()
        try:
            model_dir = build(work / name)
            result = check_family(model_dir, str(spec["device"]), str(spec["dtype"]))
        except Exception as exc:
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        seconds = time.perf_counter() - start
        print(json.dumps({"event": "family", "name": name, **result, "seconds": seconds}))
    return 0
