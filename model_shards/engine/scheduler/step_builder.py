"""The step being assembled: its chunks, their sequences, and what is left of its limits."""

from __future__ import annotations

import msgspec

from model_shards.engine.scheduler.sequence import ScheduledStep, Sequence
from model_shards.messages import LoraLoad, NewSequence, SeqChunk


class StepBuilder:
    """One step under construction.

    ``budget``: tokens it may still take; ``seats``: sequences it may still
    take. ``freed``: sequence ids the ranks drop before running the step
    (retired since the last step, then preempted in this one). ``scheduled``:
    ids of the sequences with a chunk in it; ``preempted``: whether it preempted.
    """

    def __init__(self, budget: int, seats: int, freed: list[int]) -> None:
        self.budget = budget
        self.seats = seats  # sequences this step may still take
        self.chunks: list[SeqChunk] = []
        self.sequences: list[Sequence] = []
        self.new_sequences: list[NewSequence] = []
        self.lora_loads: list[LoraLoad] = []
        self.freed = freed
        self.scheduled: set[int] = set()
        self.preempted = False

    def add(
        self,
        seq: Sequence,
        start: int,
        end: int,
        new_blocks: list[int],
        window_blocks: list[list[int]],
        drafts: list[int] | None = None,
    ) -> None:
        """Add the chunk of positions ``start .. end - 1``; it samples if it reaches the end.
        ``new_blocks``/``window_blocks``: the ids appended to KV group 0's / 1..'s tables;
        ``drafts``: proposed tokens after the sequence's last, its chunk's last positions."""
        drafts = drafts or []
        sample = end == len(seq.token_ids) + len(drafts)
        tokens = seq.token_ids[start : end - len(drafts)] + drafts
        chunk = SeqChunk(seq.seq_id, start, tokens, sample, new_blocks, window_blocks)
        cut, seq.table_cut = seq.table_cut, -1
        if drafts or cut >= 0:
            chunk = msgspec.structs.replace(chunk, num_draft=len(drafts), table_len=cut)
        self.add_chunk(seq, chunk)

    def add_chunk(self, seq: Sequence, chunk: SeqChunk) -> None:
        """Add ``seq``'s ``chunk`` as it is (its adapter slot set here)."""
        if seq.lora_slot >= 0:
            chunk = msgspec.structs.replace(chunk, lora_slot=seq.lora_slot)
        self.chunks.append(chunk)
        self.sequences.append(seq)
        self.scheduled.add(seq.seq_id)
        self.budget -= len(chunk.token_ids)
        self.seats -= 1

    @property
    def full(self) -> bool:
        return self.budget == 0 or self.seats == 0

    def build(self) -> ScheduledStep:
        return ScheduledStep(
            self.chunks, self.sequences, self.new_sequences, self.freed, self.lora_loads
        )
