"""Incremental detokenizer: no broken characters mid-stream; deltas add up to the full text."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from server.text.detokenizer import IncrementalDetokenizer
from server.text.tokenizer import Tokenizer

TEXTS = ["😀🎉🚀 emoji", "你好，世界。日本語", "héllo wörld ça va", "plain ascii text", "🚀"]


def stream(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([token]) for token in output]
    return [*deltas, detok.finish()]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_one_token_at_a_time(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode(text)[1:]  # drop BOS
    deltas = stream(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(output) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_span_tokens(tokenizer: Tokenizer) -> None:
    # Byte-level tokens of an emoji: the first pieces alone decode to U+FFFD.
    output = tokenizer.encode("🚀")[1:]
    assert len(output) > 1 and tokenizer.decode(output[:1]).endswith("\ufffd")
    deltas = stream(tokenizer, [], output)
    assert deltas[:-2] == [""] * (len(output) - 1) and "".join(deltas) == "🚀"


def test_several_tokens_per_step_and_specials(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    ids = tokenizer.encode("你好 world")[1:]
    text = detok.add(ids[:3]) + detok.add([1]) + detok.add(ids[3:]) + detok.finish()
    assert text == "你好 world"


def test_incomplete_tail_is_flushed_at_finish(tokenizer: Tokenizer) -> None:
    partial = tokenizer.encode("😀")[1:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(partial) == ""
    assert detok.finish().endswith("\ufffd")


def _sentencepiece_style(directory: Path) -> Tokenizer:
    """Llama-2 style: ▁ for spaces, byte-fallback tokens, a decoder stripping one leading space."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    pieces += ["▁", *"Helowrdfx", "▁w", "or", "ld"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [("▁", "w"), ("o", "r"), ("l", "d")]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_dir(directory)


def test_sentencepiece_leading_space_kept_with_prompt_context(tmp_path: Path) -> None:
    tokenizer = _sentencepiece_style(tmp_path / "sp")
    full = tokenizer.encode("Hello world 🚀 fox")
    split = next(i for i in range(len(full)) if tokenizer.decode(full[:i]) == "Hello")
    prompt, output = full[:split], full[split:]
    assert tokenizer.decode(output).startswith("world")  # decoded alone, the space is lost
    deltas = stream(tokenizer, prompt, output)
    assert "".join(deltas) == " world 🚀 fox"
    assert all("\ufffd" not in d for d in deltas)
