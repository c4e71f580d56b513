"""Serve a family's tiny checkpoint on a spawned world and record its greedy tokens and prompt
logits, for the parity tests against transformers."""

from __future__ import annotations

import json
from pathlib import Path

from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.worker.decoder_worker import Worker
from tests.logits import record_logits, run_prompts, save_first_logits

PROMPTS = [[3, 17, 250, 96, 42, 7, 51, 64, 100], [5, 6]]


NEW_TOKENS = 24


MAX_LEN = 128


def generate_greedy(
    coord: Coordinator, prompts: list[list[int]], new_tokens: int = NEW_TOKENS
) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        params = SamplingParams(0.0)
        coord.add_request(GenerateRequest(str(i), prompt, new_tokens, params, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while coord.has_work():
        for update in coord.step():
            tokens[update.output.request_id] += update.output.new_token_ids
    coord.step()  # flush frees
    return tokens


def serve_and_record(worker: Worker, name: str, out_dir: str) -> None:
    """One rank's part of a parity run: rank 0 runs :data:`PROMPTS` (logits recorded, then
    greedy tokens; every block freed) and writes ``name.json``, the sampling rank writes
    ``name-logits.safetensors``, every other rank serves until shut down."""
    recorder = record_logits(worker)
    if worker.ps.rank != 0:
        worker.serve_forever()
    else:
        coord = Coordinator(
            worker, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=MAX_LEN
        )
        seq_ids = run_prompts(coord, PROMPTS)
        tokens = generate_greedy(coord, PROMPTS)
        assert coord.stats.num_free_blocks == coord.stats.num_blocks, "KV blocks not freed"
        result = {"seqs": seq_ids, "tokens": tokens}
        Path(out_dir, f"{name}.json").write_text(json.dumps(result))
        coord.shutdown()
    if worker.is_sampler:
        save_first_logits(recorder, Path(out_dir, f"{name}-logits.safetensors"))
