"""``--speculative-config``: vLLM's JSON for speculative decoding, parsed and checked before spawn.

Two kinds of proposer, as vLLM spells them:

* ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min":
  M}``: prompt lookup over the sequence's own prompt and output (``prompt_lookup_*`` default as
  in vLLM: both 5 when neither is given, else the one given);
* ``{"model": DIR, "num_speculative_tokens": K}`` (``method`` ``draft_model`` or absent): a
  small draft model (a directory or a GGUF file) with the target's tokenizer, run at tp=1 in
  rank 0's process (:mod:`model_shards.engine.speculative.draft_model`); it proposes its greedy
  tokens. Checked before spawn (:func:`check_draft`): same vocabulary and tokenizer, a text-only
  decoder with one KV group, a text-only target at pp=1. ``draft_tensor_parallel_size`` (vLLM's
  key) may only be 1.

``disable_by_batch_size``: no proposals in a step whose running batch is larger (vLLM's name;
our default :data:`DEFAULT_DISABLE_BY_BATCH_SIZE`, so that loaded servers pay nothing).
Every mistake is a ``ValueError`` naming ``--speculative-config``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model_shards.config.model import ModelConfig

FLAG = "--speculative-config"
METHODS = ("ngram", "draft_model")
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
MAX_SPECULATIVE_TOKENS = 32
_DEFAULT_LOOKUP = 5
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed ``--speculative-config``; ``model`` is set for ``draft_model`` only."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None

    @staticmethod
    def parse(text: str) -> SpeculativeConfig:
        """The config of the flag's JSON text; ``ValueError`` naming the flag and the field."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{FLAG}: not valid JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{FLAG}: expected a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            known = ", ".join(sorted(_KEYS))
            raise ValueError(f"{FLAG}: unknown field(s) {', '.join(unknown)}; supported: {known}")
        method = raw.get("method", "draft_model" if "model" in raw else None)
        if method not in METHODS:
            raise ValueError(
                f"{FLAG}: method {method!r} is not served; use 'ngram' or a draft 'model'"
            )
        k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        disable = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1, None)
        if _int(raw, "draft_tensor_parallel_size", 1, 1, None) != 1:
            raise ValueError(
                f"{FLAG}: draft_tensor_parallel_size must be 1: the draft runs whole in rank 0's "
                "process, whatever the target's tensor parallelism"
            )
        if method == "draft_model":
            model = raw.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"{FLAG}: a draft model needs 'model': the draft's directory")
            return SpeculativeConfig(method, k, disable_by_batch_size=disable, model=model)
        if "model" in raw:
            raise ValueError(f"{FLAG}: method 'ngram' takes no 'model'")
        given_max, given_min = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        fallback = given_max if given_max is not None else given_min
        fallback = _DEFAULT_LOOKUP if fallback is None else fallback
        hi = _int(raw, "prompt_lookup_max", fallback, 1, None)
        lo = _int(raw, "prompt_lookup_min", hi if given_min is None else fallback, 1, None)
        if lo > hi:
            raise ValueError(f"{FLAG}: prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}")
        return SpeculativeConfig(method, k, hi, lo, disable)


def _int(raw: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None) -> int:
    """``raw[key]`` as an int in ``lo..hi`` (``default`` when absent; ``None``: required)."""
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{FLAG}: '{key}' is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{FLAG}: '{key}' must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{FLAG}: '{key}' must be {bound}, got {value}")
    return value


def check_draft(spec: SpeculativeConfig, target: ModelConfig, target_dir: str, pp: int) -> None:
    """What a draft model must be: a text-only decoder with one KV group, sharing the
    vocabulary and tokenizer of a text-only ``target`` at ``pp`` 1 (the draft runs in rank 0's
    process, which holds the first stage only at pp > 1). ``ValueError`` naming the flag."""
    from model_shards.config.kv_layout import KVLayout
    from model_shards.config.model import ModelConfig, load_model_config
    from model_shards.config.vlm import is_vlm

    assert spec.model is not None
    target_vocab = target.vocab_size
    if is_vlm(target.extra):
        raise ValueError(
            f"{FLAG}: draft models serve text-only targets; {target.architecture} has a vision "
            'tower (and its own position streams): use {"method": "ngram"}'
        )
    if pp > 1:
        raise ValueError(
            f"{FLAG}: a draft model is served with --pipeline-parallel-size 1 only (got {pp}); "
            'use {"method": "ngram"} or -pp 1'
        )
    if not Path(spec.model).exists():
        raise ValueError(f"{FLAG}: draft model {spec.model}: no such file or directory")
    draft = load_model_config(spec.model)
    if not isinstance(draft, ModelConfig):
        raise ValueError(f"{FLAG}: draft model {spec.model} is not a decoder")
    if is_vlm(draft.extra) or KVLayout.for_model(draft).num_groups > 1:
        raise ValueError(
            f"{FLAG}: draft model {spec.model}: only text-only drafts with one KV group are "
            "served (no vision tower, no mix of sliding-window and full-attention layers)"
        )
    if draft.vocab_size != target_vocab:
        raise ValueError(
            f"{FLAG}: draft model {spec.model} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target_vocab}; the draft must share the target's tokenizer"
        )
    if _tokenizer_digest(spec.model) != _tokenizer_digest(target_dir):
        raise ValueError(
            f"{FLAG}: draft model {spec.model} has another tokenizer than the target; the draft "
            "must share the target's tokenizer"
        )


def _tokenizer_digest(model_dir: str) -> str | None:
    """A digest of the tokenizer: ``tokenizer.json``'s bytes, or a GGUF's token list."""
    from model_shards.gguf.files import gguf_files, is_gguf
    from model_shards.gguf.metadata import read_gguf_metadata

    if is_gguf(model_dir):
        tokens = read_gguf_metadata(gguf_files(model_dir)[0]).get("tokenizer.ggml.tokens")
        return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    path = Path(model_dir, "tokenizer.json")
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
