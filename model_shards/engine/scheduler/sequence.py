"""One request's state on rank 0, and what a step hands to / gets back from the loop."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from model_shards.engine.scheduler.prefix_cache import BlockHash, hash_block
from model_shards.engine.speculative.proposer import SeqProposer
from model_shards.messages import (
    GenerateRequest,
    LoraLoad,
    NewSequence,
    RequestOutput,
    SamplingParams,
    SeqChunk,
)


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not on the ranks: new, or preempted (KV dropped)
    RUNNING = "running"  # on the ranks, holds blocks; prefilling or decoding
    FINISHED = "finished"  # stopped, or aborted


@dataclass(eq=False)
class Sequence:
    """A request being generated.

    ``token_ids`` is prompt + output so far; positions ``< num_computed`` are
    in the KV cache (covered by ``block_table``, and by ``window_tables``: the tables of
    KV groups 1.. when the model has several, ``-1`` where a block left the window).
    A running sequence is *decoding* when exactly its last token is not yet computed, else
    *prefilling*. ``sampling`` always carries a seed. Speculative drafts never enter
    ``token_ids``: a verify chunk carries them, and only the accepted ones are appended.
    """

    seq_id: int
    request: GenerateRequest
    sampling: SamplingParams
    client: bytes = b""  # ZMQ identity of the frontend that submitted it
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefill_end: int = 0  # len(token_ids) when last admitted: positions below are prefill
    block_table: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading full blocks offered to the prefix cache
    lora_slot: int = -1  # the LoRA adapter slot it holds while running (.lora_slots)
    proposer: SeqProposer | None = None  # speculative decoding's state, once it proposed
    table_cut: int = -1  # >= 0: the ranks cut its tables to this length with its next chunk
    _hashes: list[BlockHash] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = [*self.request.prompt_token_ids, *self.output_ids]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.token_ids) - 1

    def append_token(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_ids.append(token)

    def block_hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids``.

        Computed once per block and kept: tokens are only ever appended, so a
        full block's hash never changes (not even across a preemption). A block holding
        placeholders of an image also hashes that image's content hash and offset, so
        two different images never share K/V and the same image twice does. A request's LoRA
        adapter is hashed into its first block, so no block is shared across adapters.
        """
        if num_blocks * block_size > len(self.token_ids):
            raise ValueError(f"sequence {self.seq_id} has fewer than {num_blocks} full blocks")
        while len(self._hashes) < num_blocks:
            i = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else None
            lo, hi = i * block_size, (i + 1) * block_size
            extra = b"".join(
                m.content_hash + m.offset.to_bytes(8, "little")
                for m in self.request.media
                if m.offset < hi and m.offset + m.length > lo
            )
            if i == 0 and self.request.lora is not None:
                extra += b"lora" + msgspec.msgpack.encode(self.request.lora)
            self._hashes.append(hash_block(parent, self.token_ids[lo:hi], extra))
        return self._hashes[:num_blocks]


@dataclass(frozen=True)
class Ahead:
    """A sequence's chunk in the latest step in flight, which its next chunk follows
    (async scheduling: :mod:`.ahead`)."""

    chunk: SeqChunk
    row: int  # the chunk's row among that step's sampled tokens; -1: it samples nothing

    @property
    def end(self) -> int:
        """The first position after the chunk: where the next chunk starts."""
        return self.chunk.start_pos + len(self.chunk.token_ids)


@dataclass
class ScheduledStep:
    """One step's decisions; the coordinator copies them into a ``StepPlan``.

    Ranks apply ``freed_seq_ids`` first, then run ``chunks``. ``sequences[i]`` is
    the sequence of ``chunks[i]``.
    """

    chunks: list[SeqChunk]
    sequences: list[Sequence]
    new_sequences: list[NewSequence]
    freed_seq_ids: list[int]
    lora_loads: list[LoraLoad] = field(default_factory=list)  # adapters into slots first

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SeqUpdate:
    """A token (or the end) of one sequence, to send to ``sequence.client``."""

    sequence: Sequence
    output: RequestOutput
