"""The engine's per-token log-probabilities in the two OpenAI shapes.

Input: ``(token_id, TokenLogprob)`` pairs, one per generated token the client
is told about (see :mod:`server.text.generation` for which). A token's text is its
own decoding (:meth:`Tokenizer.token_text`), so a token holding part of a
multi-byte character shows ``\\ufffd``; ``bytes`` are that text's UTF-8 bytes.
Log-probabilities are the raw model distribution, as the engine reports them.
"""

from __future__ import annotations

from server.api.chat_protocol import ChatLogprobs, TokenLogprobEntry, TopLogprob
from server.api.completion_protocol import CompletionLogprobs
from server.text.generation import SampledToken
from server.text.tokenizer import Tokenizer


def completion_logprobs(
    tokenizer: Tokenizer, tokens: list[SampledToken], text_offset: int = 0
) -> CompletionLogprobs:
    """The legacy ``/v1/completions`` object; offsets count from ``text_offset``.

    ``top_logprobs[i]`` maps the top alternatives' texts to their logprobs, plus
    the sampled token (as vLLM does), so ``logprobs: 0`` still names it.
    """
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = text_offset
    for token_id, info in tokens:
        text = tokenizer.token_text(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(info.logprob)
        pairs = zip(info.top_ids, info.top_logprobs, strict=True)
        top = {tokenizer.token_text(t): lp for t, lp in pairs}
        top.setdefault(text, info.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer: Tokenizer, tokens: list[SampledToken]) -> ChatLogprobs:
    """The chat ``logprobs`` object: ``content`` has one entry per token, each with
    exactly the requested number of ``top_logprobs``."""
    content = []
    for token_id, info in tokens:
        text = tokenizer.token_text(token_id)
        top = []
        for top_id, top_logprob in zip(info.top_ids, info.top_logprobs, strict=True):
            top_text = tokenizer.token_text(top_id)
            top.append(TopLogprob(token=top_text, logprob=top_logprob, bytes=_utf8(top_text)))
        content.append(
            TokenLogprobEntry(token=text, logprob=info.logprob, bytes=_utf8(text), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def _utf8(text: str) -> list[int]:
    return list(text.encode())
