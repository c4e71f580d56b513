"""Tool calls in a model's own output format: the parsers of ``--tool-call-parser``.

Names and formats are vLLM's:

* ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, once per call; text before the first tag is content;
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole answer is a JSON object
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
  ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array ``[{"name", "arguments"}, ...]``
  (v3 tokenizers) or ``name[ARGS]{...}`` per call (v11+); text before it is content.

:meth:`ToolParser.extract` parses a whole answer into ``(content, calls)``;
an answer that does not parse as tool calls is all content. :meth:`ToolParser.safe_end`
says how much of a partial answer is surely content (streaming holds back anything
that may start a call). :func:`detect` picks the parser a chat template is written for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


def _call(obj: Any, *argument_keys: str) -> ParsedCall | None:
    """A call from ``{"name": str, <argument key>: object}``, or ``None``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
    return ParsedCall(obj["name"], "{}")


def _held_prefix(text: str, marker: str) -> int:
    """Where a trailing partial ``marker`` starts in ``text`` (``len(text)`` if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)


class ToolParser:
    """One model family's tool-call format (see the module docstring)."""

    name = ""
    marker = ""  # what starts the calls

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def safe_end(self, text: str) -> int:
        """Length of ``text``'s prefix that is content whatever follows."""
        at = text.find(self.marker)
        return at if at >= 0 else _held_prefix(text, self.marker)


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[at:]):
            try:
                call = _call(json.loads(body), "arguments", "parameters")
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        content = text[:at].strip()
        return content or None, calls


def _json_objects(text: str, separator: str) -> list[Any] | None:
    """The JSON values of ``text``, written one after another (``separator`` between)."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)
        rest = text[i:].lstrip()
        if rest.startswith(separator):
            rest = rest[len(separator) :].lstrip()
        i = len(text) - len(rest)
    return out


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.marker):
            body = body[len(self.marker) :].strip()
        if not body.startswith("{"):
            return text, []
        values = _json_objects(body, ";")
        calls = [_call(v, "parameters", "arguments") for v in values or []]
        if not values or any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]

    def safe_end(self, text: str) -> int:
        stripped = text.lstrip()
        if (
            not stripped
            or stripped.startswith(("{", self.marker))
            or self.marker.startswith(stripped)
        ):
            return 0  # may be a call: nothing is content until the answer is whole
        return len(text)


class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` is a special token of Mistral's tokenizers, which the detokenizer
    drops: an answer that starts with a JSON array of calls is read as calls too."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    _BARE = '[{"name"'

    def safe_end(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(self._BARE) or (stripped and self._BARE.startswith(stripped)):
            return 0
        return super().safe_end(text)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.marker)
        if at < 0:
            if not text.lstrip().startswith(self._BARE):
                return text, []
            text, at = self.marker + text.lstrip(), 0  # the detokenizer dropped the marker
        content = text[:at].strip() or None
        body = text[at + len(self.marker) :].strip()
        if body.startswith("["):
            values = _json_objects(body, "")
            if not values or not isinstance(values[0], list):
                return text, []
            calls = [_call(v, "arguments", "parameters") for v in values[0]]
        else:  # v11+: name[ARGS]{...} per call, each after its own [TOOL_CALLS]
            calls = []
            for part in body.split(self.marker):
                name, sep, args = part.partition("[ARGS]")
                try:
                    parsed = json.loads(args) if sep else None
                except json.JSONDecodeError:
                    parsed = None
                calls.append(_call({"name": name.strip(), "arguments": parsed}, "arguments"))
        if not calls or any(c is None for c in calls):
            return text, []
        return content, [c for c in calls if c is not None]


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def detect(template: str | None) -> str | None:
    """The parser a chat template's tool format is, or ``None`` when it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return None
