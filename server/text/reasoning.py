"""Reasoning in a model's output: the parsers of ``--reasoning-parser`` (vLLM's names).

Both split ``<think>…</think>`` from the answer; the tags themselves go nowhere:

* ``deepseek_r1`` (DeepSeek-R1 and its distills): the template opens the block, so the
  output starts inside the reasoning; a ``<think>`` it writes anyway is dropped. Everything
  up to ``</think>`` is reasoning, the rest content; no ``</think>`` → all reasoning;
* ``qwen3`` (Qwen3, QwQ): only an explicit ``<think>…</think>`` block is reasoning; text
  before and after it is content. Whole, an unterminated block is content (vLLM's rule);
  streamed, it has already gone out as reasoning deltas when the output ends.

:meth:`ReasoningParser.split` parses a whole answer into ``(reasoning, content)`` (``None``
for an absent part). :meth:`ReasoningParser.stream` returns a :class:`ReasoningStream` that
splits the same text arriving in pieces: a tag cut across pieces is held back until the next
piece decides it. Other modules (chat, the Responses route) call only these two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

START, END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """One output's pieces → ``(reasoning, content)`` pieces (empty strings when none).

    State: ``in_reasoning`` (inside the block), ``done`` (the block has ended: the rest is
    content), ``pending`` (text held back: it may be the start of a tag).
    """

    in_reasoning: bool
    done: bool = False
    pending: str = ""
    _out: tuple[list[str], list[str]] = field(default_factory=lambda: ([], []), repr=False)

    def feed(self, piece: str, *, last: bool = False) -> tuple[str, str]:
        """The reasoning and content that ``piece`` (after what came before) makes certain;
        with ``last``, everything left (:meth:`finish`)."""
        self._split(piece)
        if last:
            self._emit(self.pending)
            self.pending = ""
        return self._take()

    def _split(self, piece: str) -> None:
        text, self.pending = self.pending + piece, ""
        while text:
            if self.done:
                self._out[1].append(text)
                break
            tag = END if self.in_reasoning else START
            at = text.find(tag)
            if at < 0:
                keep = _held(text, tag)
                self._emit(text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                break
            self._emit(text[:at])
            text = text[at + len(tag) :]
            if self.in_reasoning:
                self.in_reasoning, self.done = False, True
            else:
                self.in_reasoning = True

    def finish(self) -> tuple[str, str]:
        """What is held back once the output is whole (a partial tag is text after all)."""
        return self.feed("", last=True)

    def _emit(self, text: str) -> None:
        if text:
            self._out[0 if self.in_reasoning else 1].append(text)

    def _take(self) -> tuple[str, str]:
        reasoning, content = ("".join(part) for part in self._out)
        self._out[0].clear()
        self._out[1].clear()
        return reasoning, content


class ReasoningParser:
    """One model family's reasoning format (see the module docstring)."""

    name = ""
    starts_in_reasoning = False  # the chat template opened the block

    def stream(self) -> ReasoningStream:
        return ReasoningStream(in_reasoning=self.starts_in_reasoning)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole answer, ``None`` for a part it lacks."""
        reasoning, content = self.stream().feed(text, last=True)
        return reasoning or None, content or None


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True

    def stream(self) -> ReasoningStream:
        return _DeepSeekStream(in_reasoning=True)


@dataclass
class _DeepSeekStream(ReasoningStream):
    """Starts inside the block; a ``<think>`` written at its very start is dropped."""

    _opened: bool = False

    def feed(self, piece: str, *, last: bool = False) -> tuple[str, str]:
        if not self._opened:
            text, self.pending = self.pending + piece, ""
            head = text.lstrip()
            if START.startswith(head) and not last:  # may still become "<think>": wait
                self.pending = text
                return "", ""
            self._opened = True
            piece = head.removeprefix(START) if head.startswith(START) else text
        return super().feed(piece, last=last)


class Qwen3Parser(ReasoningParser):
    name = "qwen3"

    def split(self, text: str) -> tuple[str | None, str | None]:
        start = text.find(START)
        if start < 0 or text.find(END, start) < 0:
            return None, text or None  # only a whole block counts
        return super().split(text)


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser ``--reasoning-parser`` names (``None`` for none); ``ValueError`` naming the
    flag for an unknown name."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
