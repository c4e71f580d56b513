"""Chat templates rendered as Hugging Face ``transformers`` renders them.

Contract: for the same template, messages and ``add_generation_prompt``,
:meth:`ChatTemplate.render` returns the string ``apply_chat_template(...,
tokenize=False)`` returns, and ``tokenizer.encode(text,
add_special_tokens=False)`` then gives the ids ``apply_chat_template(...,
tokenize=True)`` gives (the template writes its own BOS).

The environment copies transformers': a Jinja2 ``ImmutableSandboxedEnvironment``
(templates come from checkpoints: untrusted code) with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
block tag that renders its body, ``raise_exception(msg)``, a ``tojson``
filter that does not escape HTML, ``strftime_now(fmt)``, and the variables
``messages``, ``tools`` (the request's tool definitions, or None), ``documents`` (None),
``add_generation_prompt``,
the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) and a request's extra
variables (``chat_template_kwargs``).
A template that fails (``raise_exception`` included) raises
:class:`ChatTemplateError` with a message for the client.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: The variables the server sets; a request's own template variables may not name them.
SERVER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplateError(ValueError):
    """The template could not be compiled or refused the conversation."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text
    with it (for training masks); rendering just outputs the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template plus the special tokens it may reference."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, OpenAI-shaped function
        definitions, as transformers passes them; ``variables``: extra template variables,
        a request's ``chat_template_kwargs``, never one of :data:`SERVER_VARIABLES`);
        :class:`ChatTemplateError` if the template fails."""
        try:
            return self._template.render(
                **self._special_tokens,
                **(variables or {}),
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
