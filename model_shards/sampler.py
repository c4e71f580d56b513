"""Next-token sampling on the last pipeline stage.

Per sequence: greedy when ``temperature == 0``; otherwise logits are divided by
the temperature, cut to the ``top_k`` largest and to the smallest set whose
probability mass reaches ``top_p`` (always keeping the most likely token), and
a token is drawn from the softmax with the sequence's own generator. A seeded
sequence owns a generator seeded once, so its draws do not depend on what else
shares the batch.
"""

from __future__ import annotations

import secrets

import torch

from model_shards.messages import SamplingParams


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p of temperature-scaled ``logits [V]``."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative - sorted_logits.softmax(-1) >= top_p  # mass before this token
        remove[0] = False
        logits = logits.masked_fill(
            torch.zeros_like(remove).scatter(0, order, remove), float("-inf")
        )
    return logits


class Sampler:
    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}
        self._generators: dict[int, torch.Generator] = {}

    def add(self, seq_id: int, params: SamplingParams) -> None:
        self._params[seq_id] = params
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self._generators[seq_id] = torch.Generator().manual_seed(seed)

    def remove(self, seq_id: int) -> None:
        self._params.pop(seq_id, None)
        self._generators.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> torch.Tensor:
        """``logits [N, V]`` float32, one row per sequence → token ids ``[N]`` (int64, CPU)."""
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1)
        for row, seq_id in enumerate(seq_ids):
            params = self._params.get(seq_id)
            if params is None:
                raise RuntimeError(f"sequence {seq_id} has no sampling parameters")
            if params.temperature <= 0:
                continue
            scaled = filter_top_k_top_p(
                logits[row] / params.temperature, params.top_k, params.top_p
            )
            probs = scaled.softmax(-1)
            tokens[row] = torch.multinomial(probs, 1, generator=self._generators[seq_id])[0]
        return tokens
