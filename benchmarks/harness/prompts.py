"""Text prompts of an exact token count, as JSONL datasets for ``deploy/loadtest.py``.

Both HTTP servers tokenize text with the checkpoint's ``tokenizer.json`` (BOS added),
and ``transformers serve`` accepts only text prompts, so every system gets the same
text. A prompt is a run of words that are one token each with and without a leading
space; the byte-level pre-tokenizer splits on those spaces, so ``n - 1`` words plus
BOS are exactly ``n`` tokens (``n`` words for a tokenizer that adds no BOS, SmolLM2's).
Each prompt is checked after it is built.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer


def single_token_words(tokenizer: Tokenizer) -> list[str]:
    """Alphabetic vocabulary entries that stay one token alone and after a space."""
    words = []
    for token in tokenizer.get_vocab():
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            continue
        word = tokenizer.decode([token_id])
        if not word.isalpha() or not word.isascii():
            continue
        alone = tokenizer.encode(word, add_special_tokens=False).ids
        spaced = tokenizer.encode(" " + word, add_special_tokens=False).ids
        if len(alone) == 1 and len(spaced) == 1:
            words.append(word)
    return sorted(words)


def exact_prompts(tokenizer: Tokenizer, count: int, length: int, seed: str) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` token ids (BOS included where the tokenizer
    adds one), as id lists."""
    words = single_token_words(tokenizer)
    if len(words) < 50:
        raise RuntimeError(f"only {len(words)} single-token words in the vocabulary")
    added = len(tokenizer.encode("a").ids) - len(
        tokenizer.encode("a", add_special_tokens=False).ids
    )
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < count:
        text = " ".join(rng.choices(words, k=length - added))
        ids = tokenizer.encode(text).ids
        if len(ids) == length and tuple(ids) not in seen:
            seen.add(tuple(ids))
            prompts.append(ids)
    return prompts


def write_dataset(
    tokenizer: Tokenizer, prompts: list[list[int]], output_len: int, path: Path
) -> Path:
    """JSONL for ``loadtest --dataset``: the text of each prompt, re-checked for its length."""
    lines = []
    for ids in prompts:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if tokenizer.encode(text).ids != ids:
            raise RuntimeError(f"prompt does not round-trip through the tokenizer: {text!r}")
        lines.append(json.dumps({"prompt": text, "output_len": output_len}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
