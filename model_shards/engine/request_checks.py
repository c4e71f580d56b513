"""The engine's checks of one generation request: every reason it refuses one, in one place.

The frontend checks first (field ranges, token ids in the vocabulary, prompt +
``max_tokens`` within the context: 400s naming the field); the engine checks
again for any client of the ZMQ protocol, here:

* :func:`content_problem`: every token id inside the vocabulary (prompt, stop ids, the
  replayed output, logit-bias keys, allowed ids, bad words), sampling parameters finite and
  in the frontend's ranges, ``prompt_logprobs`` in range, media shapes whole (rank 0's
  coordinator, which knows the vocabulary): nothing a sampler or an embedding indexes with
  can be out of range;
* :func:`fit_problem`: an empty prompt, ``max_tokens < 1``, a prompt that fills
  the context window, a sequence whose KV at its longest exceeds the whole pool
  (the scheduler, which knows the pool).

Each returns why the request is refused, or ``None``; the caller raises the
``ValueError`` the frontend receives as an ``EngineError``. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from model_shards.messages import GenerateRequest, SamplingParams

MAX_LOGPROBS = 20
MAX_COUNT = 2**31 - 1  # token counts and top_k: int32 tensors on the ranks
MAX_TEMPERATURE = 2.0
MAX_BIAS = 100.0


def content_problem(request: GenerateRequest, vocab_size: int) -> str | None:
    """Why ``request``'s token ids or sampling parameters are refused, or ``None``."""
    if any(not 0 <= t < vocab_size for t in request.prompt_token_ids):
        return f"prompt token ids must be in [0, {vocab_size})"
    problem = _token_id_problem(request, vocab_size)
    if problem:
        return problem
    s = request.sampling
    for name, ids in (("logit_bias", s.logit_bias), ("allowed_token_ids", s.allowed_token_ids)):
        if any(not 0 <= t < vocab_size for t in ids or ()):
            return f"{name} token ids must be in [0, {vocab_size})"
    k = request.prompt_logprobs
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        return f"prompt_logprobs = {k} must be in 0..{MAX_LOGPROBS}"
    return _media_problem(request) or _sampling_problem(request.sampling)


def _token_id_problem(request: GenerateRequest, vocab_size: int) -> str | None:
    """Stop ids, the replayed output and bad words outside the vocabulary, an empty bad word
    or allowed list, counts past ``MAX_COUNT``."""
    s = request.sampling
    named = [("stop_token_ids", request.stop_token_ids)]
    named += [("resume_output_ids", request.resume_output_ids)]
    named += [("bad_words_token_ids", word) for word in s.bad_words_token_ids]
    for name, ids in named:
        if any(not 0 <= t < vocab_size for t in ids):
            return f"{name} token ids must be in [0, {vocab_size})"
    if any(not word for word in s.bad_words_token_ids):
        return "bad_words_token_ids: every bad word needs at least one token"
    if s.allowed_token_ids is not None and not s.allowed_token_ids:
        return "allowed_token_ids must not be empty (leave it out to allow every token)"
    if not request.max_tokens <= MAX_COUNT:
        return f"max_tokens must be at most {MAX_COUNT}"
    if request.resume_output_ids and len(request.resume_output_ids) >= request.max_tokens:
        return "resume_output_ids: a replayed request has fewer tokens out than max_tokens"
    return None


_MEDIA_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _media_problem(request: GenerateRequest) -> str | None:
    """Images whose placeholder runs leave the prompt, overlap or come out of order, or
    whose pixel bytes do not fill their shape and dtype."""
    end = 0
    for i, m in enumerate(request.media):
        if m.length < 1 or m.offset < end or m.offset + m.length > len(request.prompt_token_ids):
            return f"media[{i}]: placeholder run {m.offset}+{m.length} out of order or place"
        end = m.offset + m.length
        if any(d < 1 for d in [*m.shape, *m.grid_thw]):
            return f"media[{i}]: shape {m.shape} / grid {m.grid_thw} must be positive"
        if not math.isfinite(m.second_per_grid):
            return f"media[{i}]: second_per_grid = {m.second_per_grid} must be finite"
        count = 1
        for d in m.shape:
            count *= d
        if m.dtype not in _MEDIA_ITEMSIZE or count * _MEDIA_ITEMSIZE[m.dtype] != len(m.pixels):
            return f"media[{i}]: {len(m.pixels)} pixel bytes do not fill {m.dtype} {m.shape}"
    return None


def _sampling_problem(s: SamplingParams) -> str | None:
    """The first sampling parameter out of its range (NaN never is in range; the frontend's
    ranges), or ``None``."""
    bias = [v for v in s.logit_bias.values() if not -MAX_BIAS <= v <= MAX_BIAS]
    checks = (
        ("temperature", s.temperature, 0 <= s.temperature <= MAX_TEMPERATURE, "in [0, 2]"),
        ("top_p", s.top_p, 0 < s.top_p <= 1, "in (0, 1]"),
        ("top_k", s.top_k, 0 <= s.top_k <= MAX_COUNT, f"in 0..{MAX_COUNT} (0: off)"),
        ("min_p", s.min_p, 0 <= s.min_p <= 1, "in [0, 1]"),
        ("repetition_penalty", s.repetition_penalty, 0 < s.repetition_penalty <= 2, "in (0, 2]"),
        ("presence_penalty", s.presence_penalty, -2 <= s.presence_penalty <= 2, "in [-2, 2]"),
        ("frequency_penalty", s.frequency_penalty, -2 <= s.frequency_penalty <= 2, "in [-2, 2]"),
        ("min_tokens", s.min_tokens, 0 <= s.min_tokens <= MAX_COUNT, f"in 0..{MAX_COUNT}"),
        ("seed", s.seed, s.seed is None or -(2**63) <= s.seed < 2**63, "a signed 64-bit int"),
        ("logit_bias", bias[:1], not bias, f"values in [-{MAX_BIAS:g}, {MAX_BIAS:g}]"),
        (
            "logprobs",
            s.logprobs,
            s.logprobs is None or 0 <= s.logprobs <= MAX_LOGPROBS,
            f"in 0..{MAX_LOGPROBS}",
        ),
    )
    for name, value, ok, rule in checks:
        if not ok:
            return f"sampling parameters out of range: {name} = {value!r} must be {rule}"
    return None


def fit_problem(
    request: GenerateRequest,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    blocks_for: Callable[[int], int] | None = None,
) -> str | None:
    """Why ``request`` could never run on a pool of ``num_blocks`` blocks of ``block_size``
    with a context window of ``max_model_len``, or ``None``.

    "Never": an empty prompt, ``max_tokens < 1``, a prompt of ``max_model_len``
    tokens or more, or a sequence whose KV at its longest
    (``min(prompt + max_tokens, max_model_len) - 1`` tokens; the last sampled token
    is never computed) exceeds the whole pool, so that every accepted sequence can
    finish once it runs alone. ``blocks_for``: the blocks a sequence of that many KV
    positions holds at its peak (default: one table, ``ceil(tokens / block_size)``).
    """
    rid = request.request_id
    n = len(request.prompt_token_ids)
    if n == 0:
        return f"request {rid!r}: prompt is empty"
    if request.max_tokens < 1:
        return f"request {rid!r}: max_tokens must be >= 1"
    if n >= max_model_len:
        return f"request {rid!r}: prompt has {n} tokens; the context window is {max_model_len}"
    if n + len(request.resume_output_ids) >= max_model_len:
        return f"request {rid!r}: prompt and replayed output fill the context window"
    kv_tokens = min(n + request.max_tokens, max_model_len) - 1
    need = -(-kv_tokens // block_size) if blocks_for is None else blocks_for(kv_tokens)
    if need > num_blocks:
        return (
            f"request {rid!r}: {n} prompt + up to {request.max_tokens} new tokens need "
            f"{kv_tokens} KV slots, more than the whole cache ({num_blocks} blocks "
            f"of {block_size}); lower max_tokens or give the KV cache more memory"
        )
    return None
