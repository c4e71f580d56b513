"""What the Gemma 2 and Gemma 3 test checkpoints share: ids, dtype, the chat template."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import randomize, write_tokenizer

# Gemma's published template (google/gemma-2-2b-it), whitespace as released
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif "
    "%}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% "
    "endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def build_gemma(path: Path, model: transformers.PreTrainedModel, seed: int) -> Path:
    """Randomize ``model`` (float32, the shared tokenizer's ids) and save it with the
    tokenizer and Gemma's chat template into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.bos_token_id, model.config.eos_token_id = BOS_TOKEN_ID, EOS_TOKEN_ID
    model.config.pad_token_id = None
    model.generation_config.bos_token_id = BOS_TOKEN_ID
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = None
    model.to(torch.float32)
    randomize(model, seed=seed)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=False, chat_template=CHAT_TEMPLATE)
    return path
