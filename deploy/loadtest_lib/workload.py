"""What to send: synthetic prompts of a fixed token length, or a JSONL dataset.

Synthetic prompts are random common English words. When the server offers a
tokenizer (``count`` returns numbers), the words that are one token each are kept
and each prompt is fitted to exactly ``input_len`` tokens, special tokens included,
and then checked; without one, a prompt is ``input_len`` words (about as many tokens).
Each prompt draws from its own seeded generator, so prompts do not depend on the
order in which tokenizer calls finish.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TokenCounter = Callable[[str], Awaitable[int | None]]
"""``prompt → number of tokens`` as the server counts them, or ``None`` if it cannot say."""

PromptSource = Literal["server-tokenizer", "words", "dataset"]

FIT_ROUNDS = 4
TOKENIZE_PARALLELISM = 16

_WORD_TEXT = """the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her she there been one all we their has would when if
    more will other so what some time out up into no only new could these may then do
    first any my now such like our over man me even most made after also did many before
    must through back years where much your way well down should because each just those
    people how too little state good very make world still own see men work long get here
    between both life being under never day same another know while last might great old
    year off come since against go came right used take three"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: the prompt, its token count if known, the output length."""

    prompt: str
    prompt_tokens: int | None
    output_len: int


def load_dataset(path: str | Path, default_output_len: int) -> list[RequestSpec]:
    """Read ``{"prompt": str, "output_len": int (optional)}`` lines; blank lines are skipped.

    Raises ``ValueError`` naming ``file:line`` for a malformed row, and for an empty file.
    """
    specs: list[RequestSpec] = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"--dataset {path}:{lineno}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f'{where}: expected {{"prompt": "...", "output_len": N}}')
            output_len = row.get("output_len", default_output_len)
            if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
                raise ValueError(f"{where}: output_len must be a positive integer")
            specs.append(RequestSpec(row["prompt"], None, output_len))
    if not specs:
        raise ValueError(f"--dataset {path}: no prompts in the file")
    return specs


async def _single_token_words(count: TokenCounter) -> tuple[list[str], int] | None:
    """Words the server tokenizes as one token, and its per-prompt overhead (e.g. BOS).

    ``None`` when the server cannot count (one probe decides, so no flood of failures).
    """
    if await count(WORDS[0]) is None:
        return None
    sizes = await asyncio.gather(*(count(word) for word in WORDS))
    known = [(word, size) for word, size in zip(WORDS, sizes, strict=True) if size is not None]
    if not known:
        return None
    smallest = min(size for _, size in known)
    return [word for word, size in known if size == smallest], smallest - 1


async def _fit_prompt(
    rng: random.Random, words: list[str], overhead: int, input_len: int, count: TokenCounter
) -> tuple[str, int | None]:
    """Grow or shrink a word list until ``count`` says ``input_len``; the closest otherwise."""
    chosen = rng.choices(words, k=max(1, input_len - overhead))
    best: tuple[str, int | None] = (" ".join(chosen), None)
    for _ in range(FIT_ROUNDS):
        text = " ".join(chosen)
        size = await count(text)
        if size is None:
            return best
        if best[1] is None or abs(size - input_len) < abs(best[1] - input_len):
            best = (text, size)
        if size == input_len:
            break
        if size > input_len:
            chosen = chosen[: max(1, len(chosen) - (size - input_len))]
        else:
            chosen += rng.choices(words, k=input_len - size)
    return best


async def synthetic_requests(
    n: int, input_len: int, output_len: int, seed: int, count: TokenCounter
) -> tuple[list[RequestSpec], PromptSource]:
    """``n`` random prompts of ``input_len`` tokens (exact with a server tokenizer).

    Returns the specs and how their length was measured: ``server-tokenizer`` or ``words``.
    """
    rngs = [random.Random(f"prompt:{seed}:{i}") for i in range(n)]
    calibration = await _single_token_words(count)
    if calibration is None:
        specs = [
            RequestSpec(" ".join(rng.choices(WORDS, k=input_len)), None, output_len) for rng in rngs
        ]
        return specs, "words"
    words, overhead = calibration
    gate = asyncio.Semaphore(TOKENIZE_PARALLELISM)

    async def one(rng: random.Random) -> RequestSpec:
        async with gate:
            prompt, size = await _fit_prompt(rng, words, overhead, input_len, count)
        return RequestSpec(prompt, size, output_len)

    return list(await asyncio.gather(*(one(rng) for rng in rngs))), "server-tokenizer"
