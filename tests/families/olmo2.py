"""A tiny random OLMo 2 (``Olmo2ForCausalLM``) checkpoint.

6 query heads of dim 10 over one KV head: at tp=2 the q projection and ``q_norm`` split
3 + 3 heads while the single KV head (and its ``k_norm``) is replicated on both ranks,
the case where the sharded QK-norm must count that head once. intermediate 90 (45 per
rank), 3 layers (pp=2 splits 2 + 1), vocab 967 (prime, above the shared tokenizer's 960
ids: the vocab split is uneven and padded), untied LM head, rope theta 5e5. Every weight
is redrawn (norm weights ``1 + N(0, 0.1)``, so a mis-sliced ``q_norm``/``k_norm`` shows).
The tokenizer config carries OLMo 2 Instruct's Tülu-style chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.checkpoints import MAX_POSITIONS, WEIGHT_STD, randomize, write_tokenizer

NAME = "olmo2"

# allenai/OLMo-2-1124-13B-Instruct tokenizer_config.json's chat_template, verbatim
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    "{% endfor %}"
)


def build(path: Path) -> Path:
    """Write the checkpoint, ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
    config = transformers.Olmo2Config(
        vocab_size=967,
        hidden_size=60,
        intermediate_size=90,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=1,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        initializer_range=WEIGHT_STD,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = transformers.Olmo2ForCausalLM(config)
    randomize(model, seed=2024)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=False, chat_template=CHAT_TEMPLATE)
    return path
