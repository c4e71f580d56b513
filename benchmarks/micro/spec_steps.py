"""Where n-gram speculation's time goes on the speculative suite's prompts: the engine only.

The packaged SmolLM2-135M-Instruct GGUF (bfloat16) on one rank in this process, ``--threads``
op threads. Each prompt of :func:`benchmarks.harness.spec_prompts.prompts` (``--workload``,
``--tags``: the suite's own, e.g. ``editing-c1-r0-ngram``) runs alone, greedy, at most
``OUTPUT_LEN`` tokens ending at the end of turn as the suite's requests do (``--ignore-eos``:
always ``OUTPUT_LEN``), once without speculation and once per ``--configs`` entry (a
``--speculative-config`` JSON), ``--rounds`` times. Printed per config, over all prompts:

* the decode steps, the rows they computed (a verify step: ``1 + drafts``), the verify steps
  and the tokens each emitted on average, the steps that found no n-gram;
* whether every output equals the output without speculation (greedy identity);
* the process CPU time of the decode steps (the prefill step apart): median of a plain step,
  of a step without drafts, of a verify step, and the total against the run without
  speculation. CPU time, not wall clock, so that a loaded machine skews the A/B less.

Step and row counts do not depend on the machine's load: they say what a proposal policy can
save before any kernel runs::

    python -m benchmarks micro spec_steps [--workload editing] [--threads 1] \\
        [--configs '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}']
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.harness.servers import free_port
from benchmarks.harness.spec_prompts import NGRAM, OUTPUT_LEN, prompts

DEFAULT_TAGS = "editing-c1-r0-ngram,editing-c1-r1-ngram"


@dataclass
class Tally:
    """One config's decode steps over every prompt (``drafts``: per step, ``None`` without a
    proposer; ``cpu_s``: per step)."""

    drafts: list[int | None] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def line(self, name: str, base: Tally) -> str:
        if all(d is None for d in self.drafts):
            return f"{name}: {len(self.drafts)} steps; cpu ms/step {_ms(self.cpu_s)}; " + (
                f"cpu total {sum(self.cpu_s):.3f} s"
            )
        verify = [d for d in self.drafts if d]
        emitted = self.tokens - (len(self.drafts) - len(verify))  # by the verify steps
        nodraft = [t for t, d in zip(self.cpu_s, self.drafts, strict=True) if d == 0]
        checked = [t for t, d in zip(self.cpu_s, self.drafts, strict=True) if d]
        return (
            f"{name}: {len(self.drafts)} steps, {len(self.drafts) + sum(verify)} rows, "
            f"{len(verify)} verify ({emitted / max(1, len(verify)):.2f} tokens each), "
            f"{self.drafts.count(0)} without a draft; identical {self.outputs == base.outputs}; "
            f"cpu ms/step no-draft {_ms(nodraft)} verify {_ms(checked)}; "
            f"cpu total {sum(self.cpu_s):.3f} s ({sum(base.cpu_s) / sum(self.cpu_s):.3f}x)"
        )


def _ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.2f}" if values else "-"


def build(threads: int) -> tuple[Any, Any]:
    """The engine's worker on the packaged model, and its tokenizer."""
    from model_shards.config.model import ModelConfig
    from model_shards.config.replica import ReplicaConfig
    from model_shards.gguf.tokenizer import tokenizer_from_gguf
    from model_shards.launch import packaged_model
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import init_parallel
    from model_shards.worker.decoder_worker import Worker

    torch.set_num_threads(threads)
    model = str(packaged_model.packaged_gguf())
    ps = init_parallel(
        0, 1, 1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", timeout_s=60
    )
    replica = ReplicaConfig(model, dtype="bfloat16")
    worker = Worker.build(replica, ModelConfig.from_dir(model), Comm.open(ps), 1024)
    return worker, tokenizer_from_gguf(model)[0]


def run_one(worker: Any, ids: list[int], spec: Any, tally: Tally, ignore_eos: bool) -> None:
    """One request alone through a fresh coordinator; its decode steps into ``tally``."""
    from model_shards.engine.coordinator import Coordinator
    from model_shards.engine.speculative import proposer
    from model_shards.messages import GenerateRequest, SamplingParams

    drafts: list[int] = []
    propose = proposer.SeqProposer.propose

    def counted(self: proposer.SeqProposer, tokens: list[int], room: int) -> list[int]:
        out = propose(self, tokens, room)
        drafts.append(len(out))
        return out

    proposer.SeqProposer.propose = counted  # type: ignore[method-assign]
    try:
        coord = Coordinator(
            worker, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024,
            speculative=spec,
        )  # fmt: skip
        request = GenerateRequest("r", ids, OUTPUT_LEN, SamplingParams(0.0), ignore_eos=ignore_eos)
        coord.add_request(request)
        output = [t for u in coord.step() for t in u.output.new_token_ids]  # the prefill
        while coord.has_work():
            before, start = len(drafts), time.process_time()
            output += [t for u in coord.step() for t in u.output.new_token_ids]
            tally.cpu_s.append(time.process_time() - start)
            tally.drafts.append(drafts[-1] if len(drafts) > before else None)
        coord.step()  # the frees reach the worker
        coord.shutdown()
    finally:
        proposer.SeqProposer.propose = propose  # type: ignore[method-assign]
    tally.tokens += len(output)
    tally.outputs.append(output)


def main(argv: list[str] | None = None) -> int:
    from model_shards.config.speculative import SpeculativeConfig

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", default="editing", choices=("editing", "chat"))
    parser.add_argument("--tags", default=DEFAULT_TAGS, help="the suite's tags, comma-separated")
    parser.add_argument("--configs", nargs="+", default=[json.dumps(NGRAM)])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ignore-eos", action="store_true", help="every request OUTPUT_LEN")
    args = parser.parse_args(argv)
    specs = {text: SpeculativeConfig.parse(text) for text in args.configs}
    worker, tokenizer = build(args.threads)
    texts = [p for tag in args.tags.split(",") for p in prompts(args.workload, 4, tag)]
    encoded = [tokenizer.encode(p, add_special_tokens=False).ids for p in texts]
    tallies = {name: Tally() for name in ["none", *specs]}
    for _ in range(args.rounds):
        for name, tally in tallies.items():  # each config in turn, the same prompts
            for ids in encoded:
                run_one(worker, ids, specs.get(name), tally, args.ignore_eos)
    base = tallies["none"]
    for name, tally in tallies.items():
        if args.rounds > 1:
            tally.outputs = tally.outputs[: len(encoded)]
        print(tally.line(name, base))
    return 0
