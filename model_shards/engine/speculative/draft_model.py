"""A draft model on rank 0: greedy proposals for a batch of sequences, at tp=1.

The draft is a :class:`~model_shards.worker.decoder_worker.Worker` of its own, in a world of one
inside rank 0's process (whatever the target's tp): its own weights, its own small paged KV pool
and sampler, driven by step plans of its own that never leave the process. It remembers, per
sequence, the tokens its KV cache holds (``fed``). To propose ``k`` tokens after ``tokens``:

1. catch up: one chunk of the tokens after the longest common prefix of ``fed`` and ``tokens``
   (the whole prompt on first use; after a verify step, the last accepted drafts and the
   target's own token); the positions past that prefix held rejected drafts and are written
   over, so a rollback is only a shorter prefix;
2. ``k - 1`` one-token decode steps, each fed the proposal before it.

Every sequence goes in the same forwards: ``k`` draft forwards a step at most. The draft samples
greedily, so each proposal is a point mass at the draft's argmax, for which the verify rule
(:mod:`.verify`) is exactly the rejection rule: the output is the target's whatever the draft
proposes (greedy: token for token; sampled: in distribution).

Its pool (:func:`draft_pool_blocks`, logged at start) holds the positions of the sequences that
may speculate at once, ``min(max_num_seqs, disable_by_batch_size)``, at most as many as the
target's pool holds: blocks are taken as a sequence's positions need them and given back by
:meth:`DraftModel.free`; when they run short, the sequences proposed for least recently (not in
the batch at hand) are forgotten, to be caught up again from their first token. On CUDA the
draft's weights and pool come out of what the target's ``--gpu-memory-utilization`` budget left
(the target sizes its pool first, not counting the draft): leave room by lowering the flag.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Container
from dataclasses import dataclass, field

from model_shards.config.model import ModelConfig, load_model_config
from model_shards.config.replica import ReplicaConfig
from model_shards.messages import NewSequence, SamplingParams, SeqChunk, StepPlan
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, seed=0)


@dataclass
class _DraftSeq:
    fed: list[int] = field(default_factory=list)  # the tokens whose K/V the draft pool holds
    blocks: list[int] = field(default_factory=list)  # its block table in the draft pool
    settled: int = 0  # fed[:settled] was the sequence's own tokens (they only grow at the end)


class DraftModel:
    """Greedy proposals of a draft :class:`Worker` (a world of one) for rank 0's scheduler;
    a :class:`~model_shards.engine.speculative.proposer.BatchProposer`."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.block_size = worker.kv.block_size
        self._free_blocks = list(range(worker.kv.num_blocks))
        self._seqs: dict[int, _DraftSeq] = {}  # least recently proposed for first
        self._freed: list[int] = []  # dropped since the last draft step: the worker drops them
        self._step_id = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def free(self, seq_ids: list[int]) -> None:
        """Forget these sequences (unknown ids are ignored); their blocks go back to the pool."""
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None:
                self._free_blocks += seq.blocks
                self._freed.append(seq_id)

    def propose(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """``{seq_id: (tokens, k)}`` → the draft's ``k`` greedy tokens after each ``tokens``
        (none for a sequence whose positions the pool cannot hold). A sequence's ``tokens`` only
        grow at the end from call to call, until :meth:`free` drops it."""
        out: dict[int, list[int]] = {seq_id: [] for seq_id in wants}
        new: list[NewSequence] = []
        chunks = [
            c for sid, (t, k) in wants.items() if (c := self._catch_up(sid, t, k, new, wants))
        ]
        while chunks:
            sampled = self._run(chunks, new)  # one token per chunk
            new, ahead = [], []
            for chunk, token in zip(chunks, sampled, strict=True):
                drafts = out[chunk.seq_id]
                drafts.append(token)
                if len(drafts) < wants[chunk.seq_id][1]:
                    fed = self._seqs[chunk.seq_id].fed
                    ahead.append(SeqChunk(chunk.seq_id, len(fed), [token]))
                    fed.append(token)
            chunks = ahead
        return out

    def _catch_up(
        self, seq_id: int, tokens: list[int], k: int, new: list[NewSequence], keep: Container[int]
    ) -> SeqChunk | None:
        """The chunk that brings the draft's K/V of ``seq_id`` up to ``tokens`` (at least their
        last token), with the blocks for ``k - 1`` decode positions after them (forgetting
        sequences not in ``keep`` if the pool is short); ``None`` if the pool cannot hold them."""
        fresh = seq_id not in self._seqs
        seq = self._seqs.pop(seq_id, None) or _DraftSeq()
        self._seqs[seq_id] = seq  # the most recently proposed for
        start = min(_common_prefix(seq.fed, tokens, seq.settled), len(tokens) - 1)
        need = max(0, -(-(len(tokens) + k - 1) // self.block_size) - len(seq.blocks))
        idle = [sid for sid in self._seqs if sid not in keep]
        while need > len(self._free_blocks) and idle:
            self.free([idle.pop(0)])
        if need > len(self._free_blocks):
            if fresh:
                del self._seqs[seq_id]
            return None
        if fresh:
            new.append(NewSequence(seq_id, _GREEDY, num_prompt_tokens=len(tokens)))
        taken = self._free_blocks[:need]
        del self._free_blocks[:need]
        seq.blocks += taken
        seq.fed, seq.settled = list(tokens), len(tokens)
        return SeqChunk(seq_id, start, tokens[start:], new_block_ids=taken)

    def _run(self, chunks: list[SeqChunk], new: list[NewSequence]) -> list[int]:
        """One draft forward over ``chunks`` → the greedy token after each."""
        plan = StepPlan(self._step_id, chunks, new, self._freed)
        self._step_id += 1
        self._freed = []
        result = self.worker.execute(plan)
        assert result is not None  # a world of one: its rank 0 samples
        return result.get().tokens


def _common_prefix(a: list[int], b: list[int], known: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, known to be ``>= known``."""
    n = min(len(a), len(b))
    i = min(known, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def draft_pool_blocks(
    replica: ReplicaConfig, target_blocks: int, max_model_len: int, k: int
) -> int:
    """Blocks of the draft's pool: every position of ``min(max_num_seqs,
    disable_by_batch_size)`` sequences of ``max_model_len + k``, but no more than the target's
    ``target_blocks`` plus each such sequence's ``k`` decode positions (and a partial block)."""
    spec = replica.speculative
    assert spec is not None
    bs = replica.block_size
    seqs = min(replica.max_num_seqs, spec.disable_by_batch_size)
    return min(seqs * -(-(max_model_len + k) // bs), target_blocks + seqs * (-(-k // bs) + 1))


def build_draft(replica: ReplicaConfig, target: Worker, max_model_len: int) -> DraftModel | None:
    """Rank 0: load ``--speculative-config``'s draft model (checked by
    :func:`~model_shards.config.speculative.check_draft`) on the target's device, in its dtype,
    unquantized, eager, with the pool of :func:`draft_pool_blocks`; ``None`` when the flag
    names no draft model."""
    spec = replica.speculative
    if spec is None or spec.model is None:
        return None
    cfg = load_model_config(spec.model)
    assert isinstance(cfg, ModelConfig)
    length = max_model_len + spec.num_speculative_tokens
    blocks = draft_pool_blocks(
        replica, target.kv.num_blocks, max_model_len, spec.num_speculative_tokens
    )
    per_block = cfg.kv_block_bytes(1, cfg.num_layers, replica.block_size, target.dtype.itemsize)
    draft_replica = dataclasses.replace(
        replica,
        model_dir=spec.model,
        tp=1,
        pp=1,
        dtype=str(target.dtype).removeprefix("torch."),
        kv_cache_memory=blocks * per_block,
        enforce_eager=True,
        enable_lora=False,
        lora_modules=(),
        quantization=None,
        kv_cache_dtype="auto",
        pp_layer_partition="even",
        max_num_batched_tokens=max(replica.max_num_batched_tokens, length),
        speculative_config=None,
    )
    comm = Comm(single_process_state(target.ps.device))
    worker = Worker.build(draft_replica, cfg, comm, length, ops=target.ops)
    log.info(
        "draft model %s (%d layers) on %s: KV pool %d blocks x %d = %.1f MiB",
        spec.model,
        cfg.num_layers,
        target.ps.device,
        worker.kv.num_blocks,
        worker.kv.block_size,
        worker.kv.num_blocks * per_block / 2**20,
    )
    return DraftModel(worker)
