"""Prompt logits for tests, read where the production step already has them.

The step carries only sampled tokens back to rank 0. The sampling rank
(``worker.is_sampler``: the last stage's TP rank 0) is given, for each sampled
chunk, exactly the logits of the chunk's last position; for the chunk that
ends a prompt these are the logits after the whole prompt. So a test:

1. on every rank, right after :meth:`Worker.build`, calls :func:`record_logits`
   (only the sampling rank's recorder ever sees a row);
2. on rank 0, drives one 1-token greedy request per prompt through the
   coordinator with :func:`run_prompts`, which says which sequence each was;
3. reads ``recorder.first_logits[seq_id]`` on the sampling rank (with ``pp > 1``
   another process: it writes them to a file with :func:`save_first_logits`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams, SeqChunk
from model_shards.worker.decoder_worker import Worker
from model_shards.worker.sampler import SampleOutput, Sampler


class RecordingSampler(Sampler):
    """A :class:`Sampler` that also keeps, per sequence, a float32 CPU copy of the logits
    of its first sampled position (``first_logits[seq_id]``, shape ``[vocab]``)."""

    def __init__(self, sampler: Sampler) -> None:
        super().__init__(sampler.ops)
        self.first_logits: dict[int, torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, chunks: list[SeqChunk]) -> SampleOutput:
        for row, chunk in enumerate(chunks):
            if chunk.seq_id not in self.first_logits:  # copied before sampling reads them
                self.first_logits[chunk.seq_id] = logits[row].float().cpu().clone()
        return super().sample(logits, chunks)


def record_logits(worker: Worker) -> RecordingSampler:
    """Swap ``worker``'s sampler (still empty: call right after :meth:`Worker.build`)
    for a recording one, and return it."""
    recorder = RecordingSampler(worker.sampler)
    worker.sampler = recorder
    return recorder


def run_prompts(coord: Coordinator, prompts: list[list[int]]) -> list[int]:
    """Rank 0: run each prompt as its own 1-token greedy request, one after another and
    each to its end; the sequence id of each prompt's request, in order. The last
    request's blocks are released on every rank before this returns."""
    seq_ids: list[int] = []
    for i, prompt in enumerate(prompts):
        coord.add_request(GenerateRequest(f"__logits-{i}", prompt, 1, SamplingParams(0.0)))
        seen: set[int] = set()
        while coord.has_work():
            seen.update(update.sequence.seq_id for update in coord.step())
        assert len(seen) == 1, f"prompt {i}: updates of sequences {seen}"
        seq_ids.append(seen.pop())
    coord.step()  # the plan that frees the last request's blocks on the ranks
    return seq_ids


def prompt_logits(
    coord: Coordinator, recorder: RecordingSampler, prompts: list[list[int]]
) -> list[torch.Tensor]:
    """One process that is both rank 0 and the sampler: the float32 logits ``[vocab]``
    after each prompt, computed through the real step."""
    return [recorder.first_logits[s] for s in run_prompts(coord, prompts)]


def save_first_logits(recorder: RecordingSampler, path: Path) -> None:
    """Write every recorded row, keyed ``s{seq_id}`` (read back with :func:`load_rows`)."""
    save_file({f"s{s}": row for s, row in recorder.first_logits.items()}, str(path))


def load_rows(path: Path, seq_ids: list[int]) -> list[torch.Tensor]:
    """The rows :func:`save_first_logits` wrote for ``seq_ids``, in that order."""
    rows = load_file(str(path))
    return [rows[f"s{s}"] for s in seq_ids]
