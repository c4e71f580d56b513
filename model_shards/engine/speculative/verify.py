"""The accept rule of a verify step, and the counters it keeps.

The target samples a token after each of the chunk's last ``K + 1`` positions, each exactly as
non-speculative decoding would there (same logits processing, same seeded draw at the same
position). Drafts are accepted while they equal those samples; the first sample that differs
(or the one after the last draft: the bonus) is emitted too. For a proposal ``x`` that is a
point mass (n-gram), this is the standard rejection rule: ``x`` is accepted with probability
``p(x)``, and a rejection emits a sample of ``p`` given ``!= x``, i.e. of
``normalize(max(0, p - q))``. The emitted tokens are therefore distributed as the target's and,
with a seed, identical to those of decoding one token a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_shards.config.scheduler import SpecCounts


def accepted_run(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a verify step emits: ``drafts`` while they equal ``samples`` (one per draft
    position plus the bonus: ``len(drafts) + 1``), then the next sample."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} samples, got {len(samples)}")
    n = 0
    while n < len(drafts) and drafts[n] == samples[n]:
        n += 1
    return samples[: n + 1]


@dataclass
class SpecCounters:
    """Totals since start-up (see :class:`~model_shards.config.scheduler.SpecCounts`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step of a sequence: ``proposed`` drafts, the first ``accepted`` taken."""
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> SpecCounts:
        return SpecCounts(
            self.drafts, self.draft_tokens, self.accepted_tokens, tuple(self.accepted_per_pos)
        )
