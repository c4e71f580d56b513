"""Write a transformers model as llama.cpp's ``convert_hf_to_gguf.py`` would, for tests.

Names come from ``gguf``'s own tensor map (the converter's), not from shardserve's table;
``llama`` q/k rows are permuted with the converter's ``LlamaModel.permute`` and Gemma's
norm weights stored as ``1 + w``; each matrix is quantized with ``gguf.quants.quantize`` to
the type ``types`` gives its GGUF name (F16 when its rows do not split into whole blocks),
vectors stay F32. gguf's numpy code cannot quantize to the K-quants (Q4_K, Q5_K, Q6_K):
those tensors are random blocks (:func:`random_k_blocks`), not the model's weights. The metadata is what the converter writes for these architectures, with
a small GPT-2-style vocabulary of exactly ``vocab_size`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import transformers

Q = gguf.GGMLQuantizationType


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` (rows of one q or k matrix)."""
    heads = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return heads.swapaxes(1, 2).reshape(w.shape)


def _metadata(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig, arch: str) -> None:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters.get("rope_theta", 10000.0)))
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "llama":
        writer.add_vocab_size(cfg.vocab_size)


def _tokenizer(writer: gguf.GGUFWriter, vocab_size: int, eos: int) -> None:
    """A byte-level vocabulary: 256 byte tokens, two-letter merges, control tokens."""
    byte_tokens = [chr(0x100 + b) if b < 0x21 else chr(b) for b in range(256)]
    letters = "abcdefghij"
    merged = [a + b for a in letters for b in letters][: max(0, vocab_size - 256 - 3)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *merged][:vocab_size]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    types = [3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{m[0]} {m[1]}" for m in merged])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos)


# byte offsets of a block's float16 scales (d, dmin) in the K-quants, which gguf's numpy
# code cannot quantize to: their tensors are drawn as random blocks instead
_K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_k_blocks(rows: int, cols: int, kind: Q, seed: int, std: float = 0.2) -> np.ndarray:
    """Random ``kind`` blocks for a ``[rows, cols]`` tensor whose values have std ``std``:
    random quants and sub-scales, the float16 scales set so."""
    _, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, type_size), np.uint8)

    def set_scales(value: float) -> None:
        for offset in _K_SCALES[kind]:
            raw[:, :, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    set_scales(1.0)  # values are linear in the scales: measure at 1, then rescale
    set_scales(std / float(gguf.quants.dequantize(raw.reshape(rows, -1), kind).std()))
    return raw.reshape(rows, -1)


def _quantized(w: np.ndarray, kind: Q, seed: int) -> tuple[np.ndarray, Q]:
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if w.ndim == 1 or kind == Q.F32:
        return w.astype(np.float32), Q.F32
    if kind == Q.F16 or w.shape[-1] % block:
        return w.astype(np.float16), Q.F16
    if kind in _K_SCALES:
        return random_k_blocks(w.shape[0], w.shape[1], kind, seed), kind
    return gguf.quants.quantize(w, kind), kind


def write_gguf(
    model: transformers.PreTrainedModel,
    path: Path,
    arch: str,
    types: Mapping[str, Q],
    *,
    split_max_tensors: int = 0,
) -> Path:
    """Write ``model`` (float32) to ``path`` as a GGUF of ``arch``; ``types``: GGUF name
    suffix (``attn_q``, ``token_embd``, …) → tensor type (default Q8_0). Returns ``path``
    (with ``split_max_tensors``: the shards ``path``-0000i-of-0000N.gguf beside it)."""
    cfg = model.config
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(f"tiny-{arch}")
    _metadata(writer, cfg, arch)
    _tokenizer(writer, cfg.vocab_size, int(cfg.eos_token_id or 2))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for seed, (hf_name, tensor) in enumerate(model.state_dict().items()):
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(stem)
        assert gguf_name is not None, hf_name
        w = tensor.float().numpy()
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if gguf_name.endswith("q") else cfg.num_key_value_heads
            w = converter_permute(w, heads)
        if arch.startswith("gemma") and gguf_name.endswith("norm"):
            w = w + 1.0
        kind = types.get(gguf_name.rsplit(".", 1)[-1], Q.Q8_0)
        data, kind = _quantized(w, kind, seed)
        writer.add_tensor(f"{gguf_name}.{suffix}", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
