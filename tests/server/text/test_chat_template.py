"""Chat templates: the same text and ids as transformers' ``apply_chat_template``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from server.text.chat_template import ChatTemplate, ChatTemplateError
from server.text.tokenizer import Tokenizer
from tests.server.conftest import BOS_ID, write_tiny_tokenizer

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello world!"}],
    [
        {"role": "system", "content": "  You answer in French.  "},
        {"role": "user", "content": "héllo wörld 你好 😀"},
        {"role": "assistant", "content": "one two three"},
        {"role": "user", "content": "four five"},
    ],
    [{"role": "user", "content": ""}],
]

#: ChatML with tojson, loop variables and a {% generation %} block.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nDefault.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{{ messages | map(attribute='role') | list | tojson }}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _ids(encoded: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding by default, 4.x a list."""
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_ids_match_transformers(
    tokenizer_dir: Path, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours = Tokenizer.from_dir(tokenizer_dir)
    assert ours.chat_template is not None
    template = ChatTemplate(ours.chat_template, ours.special_tokens)
    text = template.render(conversation, add_generation_prompt=add_generation_prompt)
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    expected_text = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected_text
    expected_ids = reference.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == _ids(expected_ids)
    assert ids.count(BOS_ID) == 1  # the template's BOS, not doubled by the post-processor


@pytest.mark.parametrize("conversation", CONVERSATIONS[:2])
def test_chatml_from_jinja_file_matches_transformers(
    tmp_path: Path, conversation: list[dict[str, Any]]
) -> None:
    directory = write_tiny_tokenizer(tmp_path / "tok", chat_template=None)
    (directory / "chat_template.jinja").write_text(CHATML)
    ours = Tokenizer.from_dir(directory)
    assert ours.chat_template == CHATML
    text = ChatTemplate(CHATML, ours.special_tokens).render(
        conversation, add_generation_prompt=True
    )
    reference = AutoTokenizer.from_pretrained(str(directory))
    assert text == reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert '["' in text  # tojson ran, without HTML escaping


def test_named_templates_use_default(tmp_path: Path) -> None:
    directory = write_tiny_tokenizer(tmp_path / "tok", chat_template=None)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "plain {{ messages[0]['content'] }}"},
    ]
    config_path.write_text(json.dumps(config))
    assert Tokenizer.from_dir(directory).chat_template == "plain {{ messages[0]['content'] }}"


def test_no_template(tmp_path: Path) -> None:
    directory = write_tiny_tokenizer(tmp_path / "tok", chat_template=None)
    assert Tokenizer.from_dir(directory).chat_template is None


def test_raise_exception_and_failures_are_template_errors(tokenizer: Tokenizer) -> None:
    assert tokenizer.chat_template is not None
    template = ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens)
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant"):
        template.render([{"role": "tool", "content": "x"}], add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {})


def test_sandbox_blocks_attribute_escapes() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil, {}).render(
            [{"role": "user", "content": "x"}], add_generation_prompt=False
        )
