"""The built-in default model: a tiny random Llama checkpoint made on the spot.

``shardserve serve`` with no ``--model`` serves this checkpoint, so the server
starts on a machine with no network and no downloaded weights. Everything is
generated locally and deterministically:

- :func:`build_tokenizer` trains a byte-level BPE tokenizer on an English
  corpus embedded below (same JSON on every run and machine);
- :func:`write_default_model` writes a Hugging Face format Llama checkpoint
  (``config.json``, ``model.safetensors``, tokenizer files) with weights drawn
  from a seeded generator, so the files are byte-identical everywhere;
- :func:`ensure_default_model` writes it once into a cache directory,
  atomically (temp dir + rename), and reuses it afterwards.

The weights are random: the model produces fluent-looking nonsense. It exists
so that every code path (TP, PP, paging, streaming) runs without a download.

This module is server runtime code: it never imports ``transformers``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEFAULT_MODEL_DIR_NAME = "default-model-v1"
"""Directory name inside the cache; bump the suffix whenever the bytes change."""

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN)
"""Special tokens, in id order: ``<s>`` = 0 (bos), ``</s>`` = 1 (eos)."""

DEFAULT_VOCAB_SIZE = 1024
"""Vocabulary of the default tokenizer and model (divisible by 1, 2, 4, 8)."""

MIN_VOCAB_SIZE = 512
MAX_VOCAB_SIZE = 1536
"""Range :func:`build_tokenizer` accepts: the embedded corpus supports up to 1536."""

MODEL_MAX_LENGTH = 2048

DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": DEFAULT_VOCAB_SIZE,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}
"""``config.json`` of the default model (Llama, GQA 8 query / 4 key-value heads)."""

WEIGHT_SEED = 0
WEIGHT_STD = 0.02

# Files a complete default model directory holds; their presence marks it done.
MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_CORPUS_PARAGRAPHS: tuple[str, ...] = (
    "The server listens for requests over HTTP. Each request carries a prompt, and "
    "the server answers with the text that the model writes after it. When many "
    "people ask at once, the requests are gathered into batches, and the batches "
    "are spread over several copies of the model, so that nobody waits for long.",
    "A large language model is a stack of layers. Every layer reads a sequence of "
    "vectors, mixes information between positions with attention, and then passes "
    "each vector through a small feed-forward network. The last layer is followed "
    "by a projection that gives one score for every word in the vocabulary.",
    "When a model is too large for one device, its weight matrices are cut into "
    "pieces. Tensor parallelism splits every matrix by rows or by columns, and the "
    "devices add up their partial results. Pipeline parallelism gives each device "
    "a contiguous range of layers, and the hidden states travel from one stage to "
    "the next like water through a pipe.",
    "It was a quiet morning in the old town. The baker opened his shop before the "
    "sun came up, and the smell of fresh bread drifted down the narrow street. A "
    "cat slept on the warm stones near the door, while two children ran past with "
    "a red kite, laughing and shouting at the wind.",
    "She walked along the river and watched the boats go by. Some were small and "
    "painted blue, others were long and carried wood or coal. The water was cold "
    "and clear, and in the shallow places she could see fish moving slowly over "
    "the sand. Far away, a bell rang twelve times, and then the town was still.",
    "Good software is written for the people who will read it later. Names should "
    "say what a thing is for, functions should do one job, and every promise a "
    "function makes should be written down next to it. Tests check those promises, "
    "and when a test fails, its message should tell the reader what went wrong.",
    "Questions and answers: What is the capital of France? The capital of France is "
    "Paris. How many days are there in a week? There are seven days in a week. "
    "Which planet is closest to the sun? Mercury is the closest planet to the sun. "
    "Why is the sky blue? Sunlight is scattered by the air, and blue light is "
    "scattered the most.",
    "Cooking rice is simple. Rinse one cup of rice in cold water until the water "
    "runs clear. Put it in a pot with two cups of water and a pinch of salt, bring "
    "it to a boil, then cover the pot and let it simmer for about eighteen minutes. "
    "Take it off the heat and let it rest for five minutes before you serve it.",
    'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n\n'
    "for i in range(10):\n    print(i, add(i, i))\n",
    '{"name": "shardserve", "version": 1, "layers": [0, 1, 2, 3], "ok": true}\n',
)

_SUBJECTS = ("the model", "a request", "the server", "my friend", "the teacher", "our team")
_VERBS = ("reads", "writes", "sends", "finds", "opens", "checks", "starts", "answers")
_OBJECTS = (
    "a short letter",
    "the next token",
    "every message",
    "the long report",
    "a new batch",
    "the first page",
)
_PLACES = (
    "in the morning",
    "at night",
    "before dinner",
    "after the meeting",
    "on the train",
    "by the window",
)
_NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
)


def _corpus() -> list[str]:
    """The training corpus: fixed paragraphs plus deterministically generated lines."""
    lines = list(_CORPUS_PARAGRAPHS)
    for s in _SUBJECTS:
        for v in _VERBS:
            for i, o in enumerate(_OBJECTS):
                place = _PLACES[(len(s) + len(v) + i) % len(_PLACES)]
                lines.append(f"{s.capitalize()} {v} {o} {place}.")
    for n in range(0, 1000, 7):
        lines.append(f"{n} + {n % 13} = {n + n % 13}; {_NUMBER_WORDS[n % 13]} items, {n * 3}%")
    return lines


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the built-in byte-level BPE tokenizer, deterministically.

    Contract:
      - the vocabulary has exactly ``vocab_size`` entries; ids 0 and 1 are
        ``<s>`` (bos) and ``</s>`` (eos); the 256 byte symbols follow, so any
        Unicode text (emoji, CJK) encodes without an unknown token and
        ``decode(encode(text).ids, skip_special_tokens=True) == text``;
      - ``encode(text)`` prepends ``<s>`` (a ``TemplateProcessing`` post-processor);
        ``encode(text, add_special_tokens=False)`` does not;
      - the same ``vocab_size`` gives the same ``to_str()`` on every run and machine.

    Raises ``ValueError`` if ``vocab_size`` is outside
    ``[MIN_VOCAB_SIZE, MAX_VOCAB_SIZE]``.
    """
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size {vocab_size} out of range; choose {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the embedded corpus yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}"
        )
    if (tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)) != (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
    ):
        raise RuntimeError("special token ids moved; expected <s>=0 and </s>=1")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tokenizer


def tokenizer_config(max_length: int = MODEL_MAX_LENGTH) -> dict[str, Any]:
    """``tokenizer_config.json`` for :func:`build_tokenizer`'s output.

    ``transformers.AutoTokenizer`` loads ``tokenizer.json`` through
    ``PreTrainedTokenizerFast`` and yields the same ids as the raw tokenizer.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer(
    target: Path, vocab_size: int = DEFAULT_VOCAB_SIZE, max_length: int = MODEL_MAX_LENGTH
) -> Tokenizer:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``target``; return it."""
    tokenizer = build_tokenizer(vocab_size)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(target / "tokenizer.json"), pretty=True)
    _write_json(target / "tokenizer_config.json", tokenizer_config(max_length))
    return tokenizer


def default_weights(config: dict[str, Any] = DEFAULT_MODEL_CONFIG) -> dict[str, torch.Tensor]:
    """Random float32 Llama weights under their Hugging Face names.

    Matrices are ``N(0, WEIGHT_STD)`` drawn from ``torch.Generator().manual_seed(
    WEIGHT_SEED)`` in the order the names are listed (embedding, layer by layer,
    final norm, lm_head); norm weights are ones. Linear weights are
    ``[out_features, in_features]`` like ``nn.Linear``.
    """
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    head_dim = int(config["head_dim"])
    q_out = int(config["num_attention_heads"]) * head_dim
    kv_out = int(config["num_key_value_heads"]) * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, WEIGHT_STD, generator=gen)

    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        weights[f"{p}.self_attn.q_proj.weight"] = normal(q_out, hidden)
        weights[f"{p}.self_attn.k_proj.weight"] = normal(kv_out, hidden)
        weights[f"{p}.self_attn.v_proj.weight"] = normal(kv_out, hidden)
        weights[f"{p}.self_attn.o_proj.weight"] = normal(hidden, q_out)
        weights[f"{p}.mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[f"{p}.mlp.up_proj.weight"] = normal(inter, hidden)
        weights[f"{p}.mlp.down_proj.weight"] = normal(hidden, inter)
        weights[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def write_default_model(target: Path) -> None:
    """Write the default checkpoint (Hugging Face Llama format) into ``target``.

    Creates ``target`` if needed and writes :data:`MODEL_FILES`. The bytes are
    identical on every run and machine. Not atomic: use
    :func:`ensure_default_model` for a directory other processes may read.
    """
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(target, DEFAULT_VOCAB_SIZE, MODEL_MAX_LENGTH)
    config = dict(DEFAULT_MODEL_CONFIG, vocab_size=tokenizer.get_vocab_size())
    _write_json(target / "config.json", config)
    _write_json(
        target / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID},
    )
    weights_path = target / "model.safetensors"
    save_file(default_weights(config), str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors creates it 0600; the cache may be shared


def default_cache_dir() -> Path:
    """The cache root: ``$SHARDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardserve``,
    else ``~/.cache/shardserve``."""
    explicit = os.environ.get("SHARDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "shardserve"


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds every file of :data:`MODEL_FILES`."""
    return all((model_dir / name).is_file() for name in MODEL_FILES)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return ``<cache>/default-model-v1``, writing it first if it is not there.

    ``cache`` is ``cache_dir`` if given, else :func:`default_cache_dir`. The
    model is written into a temporary directory beside the target and renamed
    into place, so a reader never sees a half-written model: a crash leaves
    only a ``.default-model-v1.tmp-*`` directory, and of several processes
    starting at once one rename wins and the others discard their copies. A
    complete existing directory is returned untouched (no file is rewritten);
    an incomplete one (not made by this function) is replaced. Never downloads.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / DEFAULT_MODEL_DIR_NAME
    if is_complete(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_DIR_NAME}.tmp-", dir=cache))
    stale: Path | None = None
    try:
        write_default_model(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        if target.exists() and not is_complete(target):
            stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_DIR_NAME}.stale-", dir=cache))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.replace(target, stale / "old")
        try:
            os.replace(tmp, target)
        except OSError:
            # Lost the race: a non-empty target appeared. Fine if it is complete.
            if not is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    return target


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
