"""Tiny random Hugging Face checkpoints and transformers reference outputs.

Parity tests build a checkpoint with one of the ``build_tiny_*`` functions,
serve it with shardserve under some TP x PP layout, and compare with
:func:`hf_greedy` / :func:`hf_prompt_logits`, which run the same directory
through ``transformers`` (the reference implementation).

Shapes are chosen to hit the awkward cases:

=============  ==========================  ===================================
               tiny llama                  tiny qwen2
=============  ==========================  ===================================
hidden         64 (4 heads x head_dim 16)  64 (4 heads x head_dim 16)
kv heads       2 (GQA: tp=4 replicates)    2
intermediate   128                         128
layers         4                           6 (pp=4 splits unevenly)
vocab          1001 (odd: tp 2/4 uneven)   997 (prime)
lm_head        untied                      tied to embed_tokens
bias           none                        q/k/v bias, non-zero
rope           llama3 scaling, theta 5e5   default, theta 1e6
files          sharded + index.json        one model.safetensors
=============  ==========================  ===================================

Weights are re-drawn from a seeded generator with a larger spread than the
transformers default (matrices ``N(0, 0.2)``, norms ``1 + N(0, 0.1)``, biases
``N(0, 0.1)``) so logits spread out and greedy decoding does not collapse to a
single repeated token. Both directories hold a tokenizer (vocab
:data:`TOKENIZER_VOCAB_SIZE`, smaller than either model vocab) that
``transformers.AutoTokenizer`` loads with the same ids as ``tokenizer.json``
(the qwen2 one uses Qwen's NFC + split-regex pre-tokenizer, because transformers
forces ``Qwen2Tokenizer`` for that model type). Every byte is a function of the
seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Regex, normalizers, pre_tokenizers
from transformers.models.qwen2.tokenization_qwen2 import (
    PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX,
)

from model_shards.launch.default_model import (
    BOS_TOKEN_ID,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    build_tokenizer,
    tokenizer_config,
)

TOKENIZER_VOCAB_SIZE = 960
"""Vocab of the tokenizer shipped with the tiny checkpoints (< 997 and < 1001)."""

LLAMA_VOCAB_SIZE = 1001
QWEN2_VOCAB_SIZE = 997
MAX_POSITIONS = 256

LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LLAMA_ROPE_THETA = 500000.0
QWEN2_ROPE_THETA = 1000000.0

WEIGHT_STD = 0.2
NORM_STD = 0.1
BIAS_STD = 0.1

LLAMA_SHARD_SIZE = "300KB"
"""``max_shard_size`` for the sharded llama: ~1.1 MB of weights -> 4-5 files."""


def _common_shape() -> dict[str, Any]:
    return {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter from ``torch.Generator().manual_seed(seed)``, in name order.

    Norm weights (names ending ``norm.weight``) get ``1 + N(0, NORM_STD)``,
    biases ``N(0, BIAS_STD)``, everything else ``N(0, WEIGHT_STD)``. Tied
    parameters are drawn once (``named_parameters`` deduplicates them).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.empty(param.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                noise.normal_(0.0, NORM_STD, generator=gen).add_(1.0)
            elif name.endswith(".bias"):
                noise.normal_(0.0, BIAS_STD, generator=gen)
            else:
                noise.normal_(0.0, WEIGHT_STD, generator=gen)
            param.copy_(noise)


def write_tokenizer(path: Path, *, qwen2_style: bool, chat_template: str | None = None) -> None:
    """Write the shared test tokenizer (vocab :data:`TOKENIZER_VOCAB_SIZE`) into ``path``,
    with ``chat_template`` in its ``tokenizer_config.json`` when given.

    transformers' ``AutoTokenizer`` ignores ``tokenizer_class`` for model type
    ``qwen2`` and rebuilds the pipeline as ``Qwen2Tokenizer`` (NFC normalizer,
    Qwen split regex). For the qwen2 checkpoint the ``tokenizer.json`` is
    therefore given that same pipeline, so that ``tokenizers.Tokenizer.from_file``
    (what shardserve loads) and ``AutoTokenizer`` yield the same ids. Both
    views have exactly :data:`TOKENIZER_VOCAB_SIZE` tokens: ``pad`` is
    ``</s>`` and there is no ``unk`` (Qwen2Tokenizer would add one otherwise).
    """
    tokenizer = build_tokenizer(TOKENIZER_VOCAB_SIZE)
    if qwen2_style:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.save(str(path / "tokenizer.json"), pretty=True)
    config = dict(tokenizer_config(MAX_POSITIONS), pad_token=EOS_TOKEN, unk_token=None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save(
    model: transformers.PreTrainedModel,
    path: Path,
    max_shard_size: str | None,
    *,
    qwen2_style: bool = False,
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    write_tokenizer(path, qwen2_style=qwen2_style)


def build_tiny_llama(
    path: Path, *, sharded: bool = True, num_layers: int = 4, seed: int = 1234
) -> Path:
    """Write a tiny random ``LlamaForCausalLM`` (see the module table) into ``path``.

    With ``sharded`` the weights span several ``model-0000k-of-0000n.safetensors``
    files plus ``model.safetensors.index.json``; otherwise one
    ``model.safetensors``. ``num_layers`` and ``seed`` (the weights') other than the
    defaults: another model with the same vocabulary and tokenizer (a speculative draft).
    Returns ``path``.
    """
    config = transformers.LlamaConfig(
        **_common_shape(),
        vocab_size=LLAMA_VOCAB_SIZE,
        num_hidden_layers=num_layers,
        tie_word_embeddings=False,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": LLAMA_ROPE_THETA},
        attention_bias=False,
        mlp_bias=False,
        initializer_range=WEIGHT_STD,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    randomize(model, seed=seed)
    _save(model, Path(path), LLAMA_SHARD_SIZE if sharded else None)
    return Path(path)


def build_tiny_qwen2(path: Path) -> Path:
    """Write a tiny random ``Qwen2ForCausalLM`` (see the module table) into ``path``.

    Tied embeddings (no ``lm_head.weight`` in the file), non-zero q/k/v biases,
    6 layers, one ``model.safetensors``. Returns ``path``.
    """
    config = transformers.Qwen2Config(
        **_common_shape(),
        vocab_size=QWEN2_VOCAB_SIZE,
        num_hidden_layers=6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN2_ROPE_THETA},
        use_sliding_window=False,
        initializer_range=WEIGHT_STD,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    randomize(model, seed=4321)
    _save(model, Path(path), None, qwen2_style=True)
    return Path(path)


def load_hf_model(path: Path) -> transformers.PreTrainedModel:
    """Load ``path`` with transformers: float32, eager attention (and eager MoE experts: the
    default grouped_mm refuses the tiny checkpoints' odd sizes on CPU), eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    return model


def hf_prompt_logits(path: Path, prompt_ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(prompt_ids), vocab]`` of one forward pass over the prompt."""
    model = load_hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids], dtype=torch.long)).logits
    return logits[0]


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exactly ``max_new_tokens`` greedy (argmax) tokens after ``prompt_ids``.

    A plain loop without a KV cache: every step re-runs the whole sequence, and
    EOS does not stop it. Returns only the new tokens.
    """
    model = load_hf_model(path)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids], dtype=torch.long)).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]
