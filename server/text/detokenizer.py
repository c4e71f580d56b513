"""Incremental detokenization: token ids in, text deltas out (vLLM's offsets scheme).

Decoding each token alone breaks a multi-byte character split across tokens (``\\ufffd``) and
drops a SentencePiece leading space. So each step decodes ``ids[prefix:read]`` (already
emitted, kept as context) and ``ids[prefix:]`` and emits the difference, unless it ends in
``\\ufffd``: then it waits for more tokens. The deltas plus
:meth:`IncrementalDetokenizer.finish` concatenate to the output ids decoded after the prompt's
last few tokens (for byte-level tokenizers, exactly ``decode(output_ids)``).
"""

from __future__ import annotations

from server.text.tokenizer import Tokenizer

#: Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one sequence. Not thread-safe; one per request."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly ``""``)."""
        self._ids.extend(new_token_ids)
        return self._step(final=False)

    def finish(self) -> str:
        """Return any text held back (even an incomplete character) at end of sequence."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith("\ufffd") and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
