"""A sequence's proposer (its n-gram index, or the draft model's tokens made for it this step),
its draft length and the acceptance gate; :class:`BatchProposer`: what a draft model offers the
scheduler (:mod:`model_shards.engine.speculative.draft_model`, torch-free here).

The gate: an exponential average of the drafts accepted per verify step; while it is below
:data:`MIN_ACCEPTED` a verify step costs more than it saves (``K + 1`` rows of compute for
little more than one token), so proposals pause for :data:`PAUSE_STEPS` decode steps, then
resume with a fresh average.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from model_shards.config.speculative import SpeculativeConfig
from model_shards.engine.speculative.ngram import NgramIndex

log = logging.getLogger(__name__)

MIN_ACCEPTED = 0.5  # drafts accepted per verify step, averaged, below which proposals pause
PAUSE_STEPS = 16
_DECAY = 0.7


class BatchProposer(Protocol):
    """Proposals made for many sequences at once (a draft model on rank 0)."""

    def propose(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """``{seq_id: (tokens, k)}`` → up to ``k`` proposed tokens after each ``tokens``
        (a sequence may get none). A sequence's ``tokens`` only grow at the end from call to
        call, until :meth:`free` drops it."""
        ...

    def free(self, seq_ids: list[int]) -> None:
        """Forget these sequences (finished, aborted or preempted)."""
        ...


@dataclass
class SeqProposer:
    """Proposal state of one sequence (rank 0). ``index`` ``None``: a draft model's sequence,
    whose drafts the scheduler sets (:meth:`offer`) before the step that takes them."""

    index: NgramIndex | None
    num_speculative_tokens: int
    accepted_avg: float = float(MIN_ACCEPTED + 1)
    pause: int = 0
    offered: tuple[int, list[int]] | None = None  # (len(tokens) they follow, the drafts)

    @staticmethod
    def for_config(spec: SpeculativeConfig) -> SeqProposer:
        if spec.model is not None:
            return SeqProposer(None, spec.num_speculative_tokens)
        index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return SeqProposer(index, spec.num_speculative_tokens)

    @property
    def paused(self) -> bool:
        return self.pause > 0

    def offer(self, num_tokens: int, drafts: list[int]) -> None:
        """The draft model's proposals after the sequence's first ``num_tokens`` tokens."""
        self.offered = (num_tokens, drafts)

    def propose(self, tokens: list[int], room: int) -> list[int]:
        """Drafts after ``tokens``, at most ``room`` (and ``num_speculative_tokens``); none
        while paused, and, for a draft model, none but those offered after exactly ``tokens``."""
        if self.pause > 0:
            self.pause -= 1
            return []
        k = min(room, self.num_speculative_tokens)
        if self.index is None:
            offered, self.offered = self.offered, None
            if offered is None or offered[0] != len(tokens) or k <= 0:
                return []
            return offered[1][:k]
        return self.index.propose(tokens, k) if k > 0 else []

    def record(self, accepted: int) -> None:
        """A verify step accepted ``accepted`` drafts: update the gate."""
        self.accepted_avg = _DECAY * self.accepted_avg + (1 - _DECAY) * accepted
        if self.accepted_avg < MIN_ACCEPTED:
            self.pause = PAUSE_STEPS
            self.accepted_avg = float(MIN_ACCEPTED + 1)


def served(spec: SpeculativeConfig | None, own_positions: bool) -> SpeculativeConfig | None:
    """``spec``, unless the model tracks its own position streams (``own_positions``: M-RoPE),
    which a verify step's rolled-back positions would confuse: then speculation is off
    (logged)."""
    if spec is not None and own_positions:
        log.warning("speculative decoding off: the model has its own position streams")
        return None
    return spec
