"""A ``tokenizers.Tokenizer`` and its special tokens from a GGUF file's ``tokenizer.*`` metadata.

Contract: :func:`tokenizer_from_gguf` gives the ids llama.cpp gives for the file (and
``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=name)``, where the two agree):

* ``tokenizer.ggml.model = gpt2``: byte-level BPE over ``tokens`` and ``merges``, text split
  into words as ``tokenizer.ggml.pre`` names (:mod:`.pretokenizers`);
* ``tokenizer.ggml.model = llama``: SentencePiece BPE with byte fallback (``<0x0A>``); the
  merges are the file's, or derived from ``scores`` (a pair merges in the order of the score of
  the token it makes: llama.cpp's SPM); ``add_space_prefix`` (default true) puts ``▁`` before
  the text. Architectures ``phi3`` and ``gemma*`` get the normalizers their reference
  tokenizers have (as transformers rebuilds them).

Token types: control tokens (type 3) and the bos/eos/unk/pad tokens become special added
tokens, user-defined ones (type 4) plain added tokens, so neither is ever split. BOS/EOS are
added as ``add_bos_token``/``add_eos_token`` say (llama.cpp's defaults when absent).
The returned config holds the special-token strings and ``chat_template`` (from
``tokenizer.chat_template``; with ``tokenizer.chat_template.<name>`` variants, the
``[{name, template}]`` list ``tokenizer_config.json`` uses, the plain one named ``default``).
Unsupported or inconsistent metadata raises ``ValueError`` naming the key.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from model_shards.gguf.metadata import read_gguf_metadata
from model_shards.gguf.pretokenizers import (
    ADD_BOS_BY_DEFAULT,
    IGNORE_MERGES,
    byte_level_pre_tokenizer,
)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 5 unused, 6 byte)
SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
TEMPLATE_KEY = "tokenizer.chat_template"
GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def tokenizer_from_gguf(path: str | Path) -> tuple[_HFTokenizer, dict[str, Any]]:
    """The tokenizer and ``tokenizer_config.json``-like config the GGUF file ``path`` holds."""
    metadata = read_gguf_metadata(path)
    try:
        return build_tokenizer(metadata)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def build_tokenizer(metadata: dict[str, Any]) -> tuple[_HFTokenizer, dict[str, Any]]:
    """:func:`tokenizer_from_gguf` on metadata already read."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not isinstance(tokens, list) or not tokens:
        raise ValueError("no tokenizer in the GGUF metadata; pass --tokenizer DIR")
    if not all(isinstance(t, str) for t in tokens):
        raise ValueError("tokenizer.ggml.tokens is not a list of strings")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    specials = _special_ids(metadata, len(tokens))
    if kind == "gpt2":
        backend = _byte_level(metadata, tokens, types)
        add_bos = metadata.get("tokenizer.ggml.pre") in ADD_BOS_BY_DEFAULT
    elif kind == "llama":
        backend = _sentencepiece(metadata, tokens, specials.get("unk_token"))
        add_bos = True
    else:
        raise ValueError(
            f"tokenizer.ggml.model {kind!r} is not supported (gpt2, llama); "
            "pass --tokenizer DIR with the model's tokenizer.json"
        )
    _add_tokens(backend, tokens, types, set(specials.values()))
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(tokens, specials, add_bos, add_eos)
    config: dict[str, Any] = {name: tokens[i] for name, i in specials.items()}
    template = _chat_template(metadata)
    if template is not None:
        config["chat_template"] = template
    return backend, config


def _special_ids(metadata: dict[str, Any], n_tokens: int) -> dict[str, int]:
    ids: dict[str, int] = {}
    for name, key in SPECIAL_IDS.items():
        value = metadata.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or not 0 <= value < n_tokens:
            raise ValueError(f"{key} = {value!r} is outside the vocabulary of {n_tokens} tokens")
        ids[name] = value
    return ids


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> _HFTokenizer:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str, kind: int) -> str:  # added tokens keep their text
        if kind in (CONTROL, USER_DEFINED) or set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {
        spelled(token, kind): i for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
    }
    merges = [_split_merge(m) for m in metadata.get("tokenizer.ggml.merges") or []]
    pre = metadata.get("tokenizer.ggml.pre")
    backend = _HFTokenizer(
        _bpe(vocab, merges, ignore_merges=pre in IGNORE_MERGES, byte_fallback=False)
    )
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    """``"a b"`` -> ``("a", "b")``, the first space after the first character splitting (a
    SentencePiece piece may be a space)."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"tokenizer.ggml.merges holds {merge!r}, not two pieces")
    return merge[:cut], merge[cut + 1 :]


def _bpe(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    *,
    ignore_merges: bool = False,
    byte_fallback: bool,
    unk_token: str | None = None,
) -> models.BPE:
    try:
        return models.BPE(
            vocab,
            merges,
            unk_token=unk_token,
            fuse_unk=byte_fallback,
            byte_fallback=byte_fallback,
            ignore_merges=ignore_merges,
        )
    except Exception as exc:  # the Rust side raises a bare Exception
        raise ValueError(f"tokenizer.ggml.merges do not fit the vocabulary ({exc})") from exc


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], unk_id: int | None) -> _HFTokenizer:
    arch = metadata.get("general.architecture")
    if arch in GEMMA_ARCHS:  # runs of spaces are stored as spaces; Gemma looks them up as ▁
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [_split_merge(m) for m in metadata["tokenizer.ggml.merges"]]
    elif arch in GEMMA_ARCHS:  # Gemma's scores do not follow its merge order; the file order does
        merges = derive_merges(tokens, [-float(i) for i in range(len(tokens))])
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ValueError("tokenizer.ggml.scores is missing or not one per token")
        merges = derive_merges(tokens, [float(s) for s in scores])
    gemma = arch in GEMMA_ARCHS
    unk = tokens[unk_id] if gemma and unk_id is not None else None
    backend = _HFTokenizer(_bpe(vocab, merges, byte_fallback=True, unk_token=unk))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":  # the prefix comes from a normalizer: "  hi" -> ▁▁▁hi
        space = [normalizers.Prepend("▁")] if prefix else []
        backend.normalizer = normalizers.Sequence([*space, normalizers.Replace(" ", "▁")])
    else:
        scheme = "first" if prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme=scheme, split=False)
    if prefix and not gemma:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered pairing: every split of a token
    into two tokens is a merge, ranked by the made token's score (best first), then by
    shorter left piece; splits of one token in vocabulary order of their pieces."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = sorted(
            (ids[token[:k]], ids[token[k:]], token[:k], token[k:])
            for k in range(1, len(token))
            if token[:k] in ids and token[k:] in ids
        )
        ranked.extend((score, len(left), len(right), left, right) for _, _, left, right in pairs)
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _add_tokens(
    backend: _HFTokenizer, tokens: list[str], types: list[int], special_ids: set[int]
) -> None:
    """Control and special-id tokens as special added tokens, user-defined ones as plain
    added tokens: matched whole in the text before any split."""
    special = [t for i, t in enumerate(tokens) if types[i] == CONTROL or i in special_ids]
    plain = [t for i, t in enumerate(tokens) if types[i] == USER_DEFINED and i not in special_ids]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


def _post_processor(
    tokens: list[str], specials: dict[str, int], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """``[BOS] $A [EOS]`` as the flags say; ``ValueError`` if a flag's token id is missing."""
    ends: list[tuple[str, int]] = []
    for flag, name, wanted in (
        ("add_bos_token", "bos_token", add_bos),
        ("add_eos_token", "eos_token", add_eos),
    ):
        if not wanted:
            continue
        if name not in specials:
            raise ValueError(
                f"tokenizer.ggml.{flag} is true but tokenizer.ggml.{name}_id is missing"
            )
        ends.append((tokens[specials[name]], specials[name]))
    bos = [tokens[specials["bos_token"]]] if add_bos else []
    eos = [tokens[specials["eos_token"]]] if add_eos else []
    single = [*bos, "$A", *eos]
    pair = [*single, *bos, "$B:1", *eos]
    try:
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)
    except Exception as exc:  # a token the template syntax cannot hold (a ":" in it)
        raise ValueError(f"cannot add BOS/EOS tokens {ends} ({exc})") from exc


def _chat_template(metadata: dict[str, Any]) -> str | list[dict[str, str]] | None:
    default = metadata.get(TEMPLATE_KEY)
    named = {
        key.removeprefix(TEMPLATE_KEY + "."): value
        for key, value in metadata.items()
        if key.startswith(TEMPLATE_KEY + ".") and isinstance(value, str)
    }
    if not named:
        return default if isinstance(default, str) else None
    templates = [{"name": "default", "template": default}] if isinstance(default, str) else []
    return templates + [{"name": name, "template": t} for name, t in sorted(named.items())]
