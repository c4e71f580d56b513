"""Batched next-token sampling on the logits' device: no loop over rows, no host copy (the
top-p cut reads one flag: whether every row's cut lay among its largest probabilities).

The same tokens as :meth:`model_shards.worker.sampler.Sampler.sample` (vLLM semantics, the
spec), for every row at once. Per row, in this order:

1. penalties: repetition on tokens of prompt + output (``x / r`` where ``x > 0``, else
   ``x * r``), then ``x -= frequency * count`` and ``x -= presence * (count > 0)`` over
   the output;
2. stop tokens to ``-inf`` where ``min_tokens`` is not reached;
3. greedy rows (``temperature <= 0``) take the argmax here; the others go on with
   ``x / temperature``, cut to ``top_k`` (``x < kth largest``), to ``top_p`` (softmax,
   sorted descending, drop where the mass strictly before a token is ``>= top_p``, the
   top token kept; :mod:`model_shards.worker.top_p` finds it in each row's largest
   probabilities, no full sort) and to ``min_p`` (``softmax < min_p * max``), then one
   draw per row from the softmax with ``race(probs, seeds)`` (:meth:`Backend.exponential_race`).

Each step rounds as the per-row reference does in float32 (the same torch ops on a
``[S, V]`` tensor instead of ``[V]``; the cumulative mass is summed in float64, which
is how torch's CPU ``cumsum`` accumulates float32), so on CPU the tokens are equal.
A row that turns a stage off is left bitwise untouched by it (``top_k == 0``,
``top_p == inf``, ``min_p == 0``, repetition 1, presence and frequency 0).

:class:`SamplingTensors` holds the per-row parameters on the device; it is built from
Python values with one host → device copy per packed tensor (pinned on CUDA). Which
stages run at all is decided from the parameters on the host, never from the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from model_shards.messages import SamplingParams
from model_shards.worker.top_p import top_p_remove

Race = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (probs [S, V], seeds [S]) → [S]


def has_penalties(p: SamplingParams) -> bool:
    """Whether a row's logits depend on the tokens seen so far."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device (``S`` rows).

    ``top_k`` is 0 where off (``k <= 0`` or ``k >= V``); ``top_p`` is ``+inf`` where off
    (``top_p >= 1``), otherwise the float32 threshold; ``seeds`` are the position seeds
    (:func:`model_shards.worker.sampler.position_seed`, anything for greedy rows). The ``[S, V]``
    inputs exist only when some row needs them. The last four fields summarise the
    parameters on the host so that stages nobody uses are skipped.
    """

    temperature: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    greedy: torch.Tensor  # [S] bool, temperature <= 0
    repetition_penalty: torch.Tensor  # [S] float32
    presence_penalty: torch.Tensor  # [S] float32
    frequency_penalty: torch.Tensor  # [S] float32
    prompt_mask: torch.Tensor | None = None  # [S, V] bool: seen in prompt or output
    output_counts: torch.Tensor | None = None  # [S, V] int32: times generated
    stop_mask: torch.Tensor | None = None  # [S, V] bool: masked stop tokens
    max_top_k: int = 0  # the largest active top_k (0: no row cuts to top-k)
    any_top_p: bool = False
    any_min_p: bool = False
    all_greedy: bool = False

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        histories: Sequence[Sequence[int] | None] | None = None,
        num_prompt_tokens: Sequence[int] | None = None,
        stop_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingTensors:
        """The tensors of rows with ``params[r]`` and position seed ``seeds[r]``.

        ``histories[r]``: the tokens at positions ``0 .. p - 1`` of row ``r`` sampling
        position ``p`` (read only for rows with penalties; ``None`` counts as empty), of
        which the first ``num_prompt_tokens[r]`` are the prompt. ``stop_ids[r]``: the
        token ids to mask for row ``r`` this step (empty once ``min_tokens`` are out).
        Token ids must be below ``vocab_size``.
        """
        device = torch.device(device)
        rows = len(params)
        if len(seeds) != rows:
            raise ValueError(f"SamplingTensors.build: {rows} params but {len(seeds)} seeds")
        pin = device.type == "cuda"
        top_k = _top_k_rows(params, vocab_size)
        floats = _to_device(_float_rows(params), torch.float32, device, pin)  # [6, S]
        greedy = [int(p.temperature <= 0) for p in params]
        ints = _to_device([top_k, [int(s) for s in seeds], greedy], torch.int64, device, pin)
        tensors = cls(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            top_k=ints[0],
            seeds=ints[1],
            greedy=ints[2].bool(),
            max_top_k=max(top_k, default=0),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            all_greedy=all(greedy),
        )
        penalised = [r for r, p in enumerate(params) if has_penalties(p)]
        stops = [] if stop_ids is None else [r for r in range(rows) if stop_ids[r]]
        if penalised or stops:
            prompt_idx, output_idx = _history_indices(
                penalised, histories, num_prompt_tokens, vocab_size
            )
            stop_idx = (
                [torch.tensor(list(stop_ids[r]), dtype=torch.int64) + r * vocab_size for r in stops]
                if stop_ids is not None
                else []
            )
            tensors._add_dense(
                (prompt_idx, output_idx, stop_idx), bool(penalised), vocab_size, device, pin
            )
        return tensors

    def _add_dense(
        self,
        groups: tuple[list[torch.Tensor], ...],
        penalised: bool,
        vocab_size: int,
        device: torch.device,
        pin: bool,
    ) -> None:
        """The ``[S, V]`` inputs from flat ``row * V + token`` indices (prompt tokens,
        output tokens, stop tokens). The output is counted on the host (unique indices
        and their counts), everything travels in one copy and is written on the device
        without atomics, so the result is deterministic."""
        prompt_idx, output_idx, stop_idx = (_cat(g) for g in groups)
        output_idx, output_counts = torch.unique(output_idx, return_counts=True)
        parts = (prompt_idx, output_idx, output_counts, stop_idx)
        flat = _to_device(torch.cat(parts), torch.int64, device, pin)
        prompt_flat, output_flat, counts_flat, stop_flat = flat.split([len(t) for t in parts])
        rows = self.num_rows
        cells = rows * vocab_size
        if penalised:
            counts = torch.zeros(cells, dtype=torch.int32, device=device)
            counts[output_flat] = counts_flat.to(torch.int32)  # unique indices
            self.output_counts = counts.view(rows, vocab_size)
            seen = torch.zeros(cells, dtype=torch.bool, device=device)
            seen = seen.index_fill_(0, prompt_flat, True).view(rows, vocab_size)
            self.prompt_mask = seen | (self.output_counts > 0)
        if len(stop_idx):
            stop = torch.zeros(cells, dtype=torch.bool, device=device)
            self.stop_mask = stop.index_fill_(0, stop_flat, True).view(rows, vocab_size)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _top_k_rows(params: Sequence[SamplingParams], vocab_size: int) -> list[int]:
    """Each row's top-k, 0 where the stage is off (the reference cuts when ``0 < k < V``)."""
    return [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]


def _float_rows(params: Sequence[SamplingParams]) -> list[list[float]]:
    """temperature, top_p (``inf`` = off), min_p, repetition, presence, frequency."""
    return [
        [p.temperature for p in params],
        [p.top_p if p.top_p < 1.0 else math.inf for p in params],
        [p.min_p for p in params],
        [p.repetition_penalty for p in params],
        [p.presence_penalty for p in params],
        [p.frequency_penalty for p in params],
    ]


def _to_device(
    data: list[list[float]] | list[list[int]] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    pin: bool,
) -> torch.Tensor:
    """One host → device copy (from pinned memory when ``pin``, then asynchronous)."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    if pin:
        host = host.pin_memory()
    return host.to(device, non_blocking=pin)


def _history_indices(
    rows: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None,
    num_prompt_tokens: Sequence[int] | None,
    vocab_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Flat ``row * V + token`` indices of the prompt and of the output tokens of
    ``rows``' histories (duplicates kept: the output ones are counted)."""
    prompt: list[torch.Tensor] = []
    output: list[torch.Tensor] = []
    for r in rows:
        history = histories[r] if histories is not None else None
        if not history:
            continue
        n = num_prompt_tokens[r] if num_prompt_tokens is not None else 0
        tokens = torch.tensor(list(history), dtype=torch.int64) + r * vocab_size
        prompt.append(tokens[:n])
        output.append(tokens[n:])
    return prompt, output


def apply_penalties_batch(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition, frequency and presence penalties on float32 ``x [S, V]`` (new tensor)."""
    if t.output_counts is None or t.prompt_mask is None:
        return x
    r = t.repetition_penalty[:, None]  # [S, 1]
    x = torch.where(t.prompt_mask, torch.where(x > 0, x / r, x * r), x)
    counts = t.output_counts.float()  # [S, V]
    x = x - t.frequency_penalty[:, None] * counts
    return x - t.presence_penalty[:, None] * (counts > 0).float()


def filter_logits_batch(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """top-k, top-p and min-p of temperature-scaled float32 ``x [S, V]``: cut to -inf."""
    if t.max_top_k > 0:
        top = torch.topk(x, t.max_top_k, dim=-1).values  # [S, kmax], descending
        kth = top.gather(1, (t.top_k - 1).clamp(min=0)[:, None])  # [S, 1]
        x = x.masked_fill((x < kth) & (t.top_k > 0)[:, None], float("-inf"))
    if t.any_top_p:  # without a full sort where the cut lies in each row's top C
        x = x.masked_fill(top_p_remove(x, t.top_p), float("-inf"))
    if t.any_min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < t.min_p[:, None] * probs.amax(-1, keepdim=True), -math.inf)
    return x


def sample_batch(logits: torch.Tensor, t: SamplingTensors, race: Race) -> torch.Tensor:
    """``logits [S, V]`` (any float dtype, any device) → tokens ``[S]`` int64.

    ``race`` draws from ``probs [S, V]`` float32 with ``t.seeds``: the backend's
    :meth:`exponential_race` (the reference on CPU, the Triton kernel on a GPU).
    """
    if logits.dim() != 2 or logits.shape[0] != t.num_rows:
        raise ValueError(
            f"sample_batch: logits must be [S, V] with S = {t.num_rows}, got {tuple(logits.shape)}"
        )
    x = apply_penalties_batch(logits.float(), t)  # [S, V] float32
    if t.stop_mask is not None:
        x = x.masked_fill(t.stop_mask, float("-inf"))
    greedy_tokens = x.argmax(dim=-1)  # [S]
    if t.all_greedy:
        return greedy_tokens
    x = x / torch.where(t.greedy, 1.0, t.temperature)[:, None]
    probs = filter_logits_batch(x, t).softmax(-1)  # [S, V]
    return torch.where(t.greedy, greedy_tokens, race(probs, t.seeds))
