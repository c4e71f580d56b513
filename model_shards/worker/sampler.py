"""Next-token sampling on the last pipeline stage (TP rank 0).

Per sequence, in this order (vLLM semantics):

0. ``logit_bias`` added (and ``-inf`` to the bad words' next tokens), then tokens
   outside ``allowed_token_ids`` and outside the
   step's grammar mask (:class:`~model_shards.messages.TokenMask`, computed by rank 0
   and sent with the plan) set to ``-inf`` (:mod:`model_shards.engine.structured.bitmask`);
1. penalties from the tokens seen so far (repetition over prompt + output,
   presence and frequency over output);
2. stop tokens masked while fewer than ``min_tokens`` tokens are out;
3. greedy when ``temperature == 0``; otherwise logits / temperature, cut to
   ``top_k``, to the ``top_p`` mass (the top token always kept) and to
   ``min_p`` × the top probability, then one draw from the softmax
   (the backend's ``exponential_race``).

Draws are stateless: the token at position ``p`` is drawn with uniforms hashed
from ``(seed, p)`` and the token ids. The same seed gives the same text whatever
else is in the batch, and a preempted or replayed sequence draws exactly as before.
Log-probabilities are those of the raw model distribution (before penalties
and temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_shards.backends.base import Backend
from model_shards.engine.structured import bitmask
from model_shards.messages import NewSequence, SamplingParams, SeqChunk, TokenMask
from model_shards.splitmix import GOLDEN, mix64
from model_shards.worker.sampling_batch import SamplingTensors, sample_batch


def position_seed(seed: int, position: int) -> int:
    """The 63-bit seed of the draw at ``position`` of a request seeded ``seed``: splitmix64's
    output function of ``seed × GOLDEN + position + 1`` (:mod:`model_shards.splitmix`)."""
    return mix64(seed * GOLDEN + position + 1) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p / min-p of temperature-scaled ``logits [V]``."""
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.sort(logits.softmax(-1), descending=True, stable=True)
        remove = probs.cumsum(-1) - probs >= params.top_p  # mass strictly before this token
        remove[0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), -torch.inf)
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def apply_penalties(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties on ``logits [V]``."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.int64)
        vals = logits[seen]
        r = params.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / r, vals * r)
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[-1]).float()
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).float()
    return logits


@dataclass
class _SeqState:
    params: SamplingParams
    num_prompt_tokens: int
    stop_token_ids: list[int]
    history: list[int] | None  # every token fed so far; kept only when penalties need it
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: ids, values
    allowed_words: torch.Tensor | None = None  # allowed_token_ids as a [W] mask, once V known


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] float32, the sampled tokens'
    top_ids: torch.Tensor | None = None  # [S, K] int64
    top_logprobs: torch.Tensor | None = None  # [S, K] float32


class Sampler:
    def __init__(self, ops: Backend) -> None:
        self.ops = ops  # argmax and the draw
        self._seqs: dict[int, _SeqState] = {}
        self._step_masks: dict[int, bytes] = {}  # seq id → this step's grammar mask

    def add(self, new: NewSequence) -> None:
        p = new.sampling
        bias = None
        if p.logit_bias:
            ids = sorted(p.logit_bias)
            values = [p.logit_bias[i] for i in ids]
            bias = (torch.tensor(ids, dtype=torch.int64), torch.tensor(values, dtype=torch.float32))
        self._seqs[new.seq_id] = _SeqState(
            p,
            new.num_prompt_tokens,
            list(new.stop_token_ids),
            [] if p.needs_history else None,
            bias,
        )

    def set_masks(self, masks: list[TokenMask]) -> None:
        """This step's grammar masks (replacing the previous step's)."""
        self._step_masks = {m.seq_id: m.words for m in masks}

    def remove(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def observe(self, chunk: SeqChunk) -> None:
        """Record the tokens a step feeds (penalties need the history)."""
        state = self._seqs.get(chunk.seq_id)
        if state is not None and state.history is not None:
            del state.history[chunk.start_pos :]
            state.history.extend(chunk.token_ids)

    def num_logprobs(self, chunks: list[SeqChunk]) -> int | None:
        """The largest top-N any sampled sequence of this step asked for (``None``: none asked)."""
        asked = [n for c in chunks if (n := self._seqs[c.seq_id].params.logprobs) is not None]
        return max(asked) if asked else None

    @staticmethod
    def _masks_stops(state: _SeqState, chunk: SeqChunk) -> bool:
        """Whether this chunk's token has its stop tokens masked (``min_tokens`` not reached)."""
        num_out = chunk.start_pos + len(chunk.token_ids) - state.num_prompt_tokens
        return num_out < state.params.min_tokens and bool(state.stop_token_ids)

    def _is_plain_greedy(self, chunk: SeqChunk) -> bool:
        """Whether this chunk's token is the raw argmax (no penalty, no masked stop, no draw)."""
        state = self._seqs.get(chunk.seq_id)
        if state is None:
            return False  # sample() raises for it
        return (
            state.params.is_greedy_plain
            and not self._masks_stops(state, chunk)
            and chunk.seq_id not in self._step_masks
        )

    def _adjustments(self, chunks: list[SeqChunk], vocab_size: int) -> list[bitmask.RowAdjustment]:
        """Each row's bias and allowed-token mask (allowed ids ∧ grammar), rows that have one."""
        rows = []
        for row, chunk in enumerate(chunks):
            state = self._state(chunk)
            ids = state.params.allowed_token_ids
            if ids is not None and state.allowed_words is None:
                state.allowed_words = bitmask.pack(ids, vocab_size)
            mask = state.allowed_words
            words = self._step_masks.get(chunk.seq_id)
            if words is not None:
                grammar = bitmask.from_bytes(words, vocab_size)
                mask = grammar if mask is None else mask & grammar
            bias = _with_bad_words(state, chunk)
            if bias is not None or mask is not None:
                rows.append(bitmask.RowAdjustment(row, bias, mask))
        return rows

    def _state(self, chunk: SeqChunk) -> _SeqState:
        state = self._seqs.get(chunk.seq_id)
        if state is None:
            raise RuntimeError(f"sequence {chunk.seq_id} has no sampling parameters")
        return state

    def sample(self, logits: torch.Tensor, chunks: list[SeqChunk]) -> SampleOutput:
        """``logits [S, V]``, one row per sampled chunk, in order → tokens ``[S]``.

        A batch of plain greedy rows is one argmax of the raw logits (the argmax of any
        float dtype is that of its float32 widening). When some row needs more (penalties,
        masked stops, a draw, logprobs), a backend that samples on the device does it all
        there; otherwise the logits are widened to float32 on the CPU, row by row. The
        output stays where it was made (the device, or the host): the caller moves it.
        """
        k = self.num_logprobs(chunks)
        if k is None and all(self._is_plain_greedy(c) for c in chunks):
            return SampleOutput(self.ops.argmax(logits))  # on the logits' device
        adjust = self._adjustments(chunks, logits.shape[-1])
        if self.ops.samples_on_device:
            return self._sample_on_device(logits, chunks, k, adjust)
        logits = logits.float().cpu()
        adjusted = bitmask.adjust_logits(logits, adjust) if adjust else logits  # [S, V]
        tokens = self.ops.argmax(adjusted).cpu()
        drawn: list[int] = []  # rows of the random draws, made together at the end
        seeds: list[int] = []
        probs: list[torch.Tensor] = []
        for row, chunk in enumerate(chunks):
            state = self._state(chunk)
            params = state.params
            position = chunk.start_pos + len(chunk.token_ids)
            masks_stops = self._masks_stops(state, chunk)
            if params.is_greedy_plain and not masks_stops:
                continue
            x = adjusted[row]
            if state.history is not None:
                history = state.history[:position]
                n = state.num_prompt_tokens
                x = apply_penalties(x, history[:n], history[n:], params)
            if masks_stops:
                x = x.clone()
                x[state.stop_token_ids] = float("-inf")
            if params.temperature <= 0:
                tokens[row] = x.argmax()
                continue
            assert params.seed is not None, "rank 0 assigns every sequence a seed"
            drawn.append(row)
            seeds.append(position_seed(params.seed, position))
            probs.append(filter_logits(x / params.temperature, params).softmax(-1))
        if drawn:
            tokens[drawn] = self.ops.exponential_race(torch.stack(probs), torch.tensor(seeds))
        return _with_logprobs(tokens, logits, k)

    def _sample_on_device(
        self,
        logits: torch.Tensor,
        chunks: list[SeqChunk],
        k: int | None,
        adjust: list[bitmask.RowAdjustment],
    ) -> SampleOutput:
        """The same tokens as the host path, batched on the logits' device
        (:func:`model_shards.worker.sampling_batch.sample_batch`, after ``adjust`` there): the
        logits stay there, and only the sampled ids (and asked-for logprobs) come back."""
        params, seeds, histories, prompts, stops = [], [], [], [], []
        for chunk in chunks:
            state = self._state(chunk)
            position = chunk.start_pos + len(chunk.token_ids)
            params.append(state.params)
            seed = state.params.seed
            seeds.append(position_seed(seed, position) if seed is not None else 0)
            histories.append(state.history[:position] if state.history is not None else None)
            prompts.append(state.num_prompt_tokens)
            stops.append(state.stop_token_ids if self._masks_stops(state, chunk) else [])
        t = SamplingTensors.build(
            params, seeds, logits.shape[-1], logits.device, histories, prompts, stops
        )
        adjusted = bitmask.adjust_logits(logits, adjust) if adjust else logits
        tokens = sample_batch(adjusted, t, self.ops.exponential_race)
        return SampleOutput(tokens) if k is None else _with_logprobs(tokens, logits.float(), k)


def _with_bad_words(state: _SeqState, chunk: SeqChunk) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The row's ``logit_bias`` plus ``-inf`` on each bad word's token that would complete
    it at this chunk's sampled position (the output so far ends with the word's prefix)."""
    words = state.params.bad_words_token_ids
    if not words:
        return state.bias
    position = chunk.start_pos + len(chunk.token_ids)
    history = state.history[:position] if state.history is not None else []
    output = history[state.num_prompt_tokens :]
    banned = sorted(
        w[-1]
        for w in words
        if len(w) == 1
        or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1 :] == w[:-1])
    )
    if not banned:
        return state.bias
    ids = torch.tensor(banned, dtype=torch.int64)
    values = torch.full((len(banned),), float("-inf"))
    if state.bias is None:
        return ids, values
    return torch.cat([state.bias[0], ids]), torch.cat([state.bias[1], values])


def _with_logprobs(tokens: torch.Tensor, logits: torch.Tensor, k: int | None) -> SampleOutput:
    """``tokens`` with the raw distribution's logprobs of them and the top ``k`` (float32
    ``logits``); just the tokens when no sequence asked (``k`` is ``None``)."""
    if k is None:
        return SampleOutput(tokens)
    logp = logits.log_softmax(-1)
    top = logp.topk(k, dim=-1)
    return SampleOutput(tokens, logp.gather(1, tokens[:, None])[:, 0], top.indices, top.values)
