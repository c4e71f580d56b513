"""Every rank's M-RoPE positions of its sequences (Qwen2.5-VL), and each step's per-token
rotary rows (the :class:`~model_shards.models.decoder.StepPositions` hook the worker calls).

A sequence's prompt positions ``[3, L]`` and its ``delta`` are computed once, when its
``NewSequence`` arrives (again after a preemption), from the media metadata alone (each
item's ``offset``, ``length``, ``grid_thw``, ``kind`` and ``second_per_grid``; no token
ids): :func:`~model_shards.models.qwen2_5_vl.rope.run_positions`. A chunk at
``start_pos`` (mid-prompt after a prefix-cache hit or a chunk boundary) takes the columns
``start_pos ..``; a position past the prompt (decode, or a recomputed output token) is
``p + delta`` on all three streams. Sequences without media have plain positions: a step
holding only those gets no rows and the model's ordinary tables serve it.

Rows: frequency ``k`` of ``head_dim / 2`` turns with stream ``s(k)``, the streams taking
``mrope_section = [t, h, w]`` consecutive frequencies (transformers'
``Qwen2_5_VLRotaryEmbedding.recomposition_frequencies``); ``cos/sin [T, head_dim]``
float32, both halves equal, as the ordinary tables' rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_shards.messages import MediaInput, NewSequence, SeqChunk, StepPlan
from model_shards.models.qwen2_5_vl.rope import MediaRun, run_positions


@dataclass(frozen=True)
class _SeqPositions:
    prompt: torch.Tensor  # [3, L] long
    delta: int


def media_runs(media: Sequence[MediaInput], tokens_per_second: float) -> list[MediaRun]:
    """The prompt's media runs (``ValueError`` for an item without a 3-entry grid)."""
    runs = []
    for item in media:
        if len(item.grid_thw) != 3:
            raise ValueError(f"media at {item.offset}: grid_thw {item.grid_thw} is not [t, h, w]")
        t, h, w = (int(g) for g in item.grid_thw)
        video = item.kind == "video"
        interval = tokens_per_second * item.second_per_grid if video else 1.0
        runs.append(MediaRun(item.offset, item.length, (t, h, w), interval))
    return runs


class MRopePositions:
    """The sequences' M-RoPE positions on one rank (see the module docstring)."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        mrope_section: Sequence[int],
        merge: int,
        tokens_per_second: float,
        device: torch.device,
    ) -> None:
        """``inv_freq [head_dim / 2]`` float32, ``mrope_section``: frequencies per stream."""
        if sum(mrope_section) != inv_freq.numel():
            raise ValueError(
                f"mrope_section {list(mrope_section)} does not cover {inv_freq.numel()}"
            )
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        streams = torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section)))
        self.streams = streams.to(device)  # [D / 2] which stream each frequency turns with
        self.merge = merge
        self.tokens_per_second = tokens_per_second
        self.device = device
        self.by_seq: dict[int, _SeqPositions] = {}

    def add(self, new: NewSequence) -> None:
        if not new.media:
            self.by_seq.pop(new.seq_id, None)
            return
        runs = media_runs(new.media, self.tokens_per_second)
        prompt, delta = run_positions(new.num_prompt_tokens, runs, self.merge)
        self.by_seq[new.seq_id] = _SeqPositions(prompt, delta)

    def observe(self, plan: StepPlan) -> None:
        """Forget freed sequences, then take the plan's new ones."""
        for seq_id in plan.freed_seq_ids:
            self.by_seq.pop(seq_id, None)
        for new in plan.new_sequences:
            self.add(new)

    def positions(self, chunks: Sequence[SeqChunk]) -> torch.Tensor | None:
        """``[3, T]`` long positions of the chunks' tokens (concatenated), or ``None`` when
        no chunk belongs to a sequence with media (all positions plain)."""
        if not any(c.seq_id in self.by_seq for c in chunks):
            return None
        parts = []
        for c in chunks:
            lo, hi = c.start_pos, c.start_pos + len(c.token_ids)
            seq = self.by_seq.get(c.seq_id)
            if seq is None:
                parts.append(torch.arange(lo, hi).expand(3, -1))
                continue
            size = seq.prompt.shape[1]
            head = seq.prompt[:, min(lo, size) : min(hi, size)]  # [3, prompt part]
            tail = torch.arange(max(lo, size), max(hi, size)) + seq.delta
            parts.append(torch.cat([head, tail.expand(3, -1)], dim=1))
        return torch.cat(parts, dim=1)

    def rotary_rows(self, chunks: Sequence[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-token ``(cos, sin)``, each ``[T, head_dim]`` float32, or ``None`` (plain)."""
        pos = self.positions(chunks)
        if pos is None:
            return None
        pos = pos.to(self.device)
        angles = pos[..., None].float() * self.inv_freq  # [3, T, D/2]
        index = self.streams.view(1, 1, -1).expand(1, pos.shape[1], -1)
        freqs = angles.gather(0, index)[0]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
