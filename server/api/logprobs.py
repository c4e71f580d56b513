"""The engine's per-token log-probabilities in the two OpenAI shapes, and a prompt's.

Input: ``(token_id, TokenLogprob)`` pairs, one per generated token the client
is told about (see :mod:`server.text.generation` for which), or a prompt's ids and the
engine's :class:`PromptLogprobs` (scores of tokens 1..). A token's text is its
own decoding (:meth:`Tokenizer.token_text`), so a token holding part of a
multi-byte character shows ``\\ufffd``; ``bytes`` are that text's UTF-8 bytes.
Log-probabilities are the raw model distribution, as the engine reports them.
"""

from __future__ import annotations

from model_shards.messages import PromptLogprobs, TokenLogprob
from server.api.chat_protocol import ChatLogprobs, TokenLogprobEntry, TopLogprob
from server.api.completion_protocol import (
    CompletionLogprobs,
    PromptLogprobsList,
    PromptTokenLogprob,
)
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


def echo_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], scores: PromptLogprobs, top_n: int
) -> CompletionLogprobs:
    """The legacy object over an echoed prompt (offsets from 0): the first token's logprob
    and top alternatives are ``null``; the others' as :func:`completion_logprobs` gives
    them, with ``top_n`` alternatives."""
    first = tokenizer.token_text(prompt_ids[0])
    out = CompletionLogprobs(
        tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0]
    )
    rest = [
        (token_id, TokenLogprob(lp, ids[:top_n], tops[:top_n]))
        for token_id, lp, ids, tops in zip(
            prompt_ids[1:], scores.logprobs, scores.top_ids, scores.top_logprobs, strict=True
        )
    ]
    return joined(out, completion_logprobs(tokenizer, rest, len(first)))


def joined(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    """``head``'s tokens, then ``tail``'s (offsets as they are)."""
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )


def end_offset(logprobs: CompletionLogprobs) -> int:
    """The text offset just after the last token of ``logprobs``."""
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], scores: PromptLogprobs, top_n: int
) -> PromptLogprobsList:
    """vLLM's ``prompt_logprobs``: ``None`` for the first token, then per token its own entry
    (its rank in the distribution) and the ``top_n`` most likely (ranks 1..top_n)."""
    out: PromptLogprobsList = [None]
    columns = (scores.logprobs, scores.ranks, scores.top_ids, scores.top_logprobs)
    for token_id, (lp, rank, ids, tops) in zip(
        prompt_ids[1:], zip(*columns, strict=True), strict=True
    ):
        ranked = zip(ids[:top_n], tops[:top_n], range(1, len(ids[:top_n]) + 1), strict=True)
        entries = [(token_id, lp, rank), *ranked]
        entry: dict[str, PromptTokenLogprob] = {}
        for entry_id, entry_lp, entry_rank in entries:
            decoded = tokenizer.token_text(entry_id)
            entry.setdefault(
                str(entry_id),
                PromptTokenLogprob(logprob=entry_lp, rank=entry_rank, decoded_token=decoded),
            )
        out.append(entry)
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
