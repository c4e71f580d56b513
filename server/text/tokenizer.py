"""Text ↔ token ids for one checkpoint, with the ``tokenizers`` library only.

Contract: :meth:`Tokenizer.encode` returns the ids
``transformers.AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`` returns
for the same directory (for a GGUF checkpoint without a ``tokenizer.json`` beside it, the
ids its metadata describes: :mod:`model_shards.gguf.tokenizer`). With ``tokenizer.json``
present, transformers >= 5 takes special tokens from that file's post-processor (a BOS it
adds is added once, here too) and drops ``add_bos_token``/``add_eos_token`` from
``tokenizer_config.json``; we do the same, so no BOS is ever doubled. From
``tokenizer_config.json`` we read the BOS/EOS token strings.

:meth:`Tokenizer.decode` skips special tokens and ids outside the vocabulary
(an engine's embedding table may be padded past it). Text cleanup
(``clean_up_tokenization_spaces``) is not applied, as in vLLM's streaming path.

The chat template is read as transformers reads it: ``chat_template.jinja`` in
the checkpoint directory if present, else ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of which
``default`` is used). :attr:`Tokenizer.special_tokens` holds the special-token
strings a template may use (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from model_shards.gguf.files import gguf_files, is_gguf
from model_shards.gguf.tokenizer import tokenizer_from_gguf
from server.http import ttft_trace


def _token_string(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _template_from_config(config: dict[str, Any]) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` plus ``tokenizer_config.json``, or the
    same built from GGUF metadata."""

    def __init__(
        self,
        backend: _HFTokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        config = config or {}
        self.special_tokens = {
            key: token
            for key in _SPECIAL_TOKEN_KEYS
            if (token := _token_string(config.get(key))) is not None
        }
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.chat_template = chat_template or _template_from_config(config)
        self._token_texts: dict[int, str] = {}
        self._truncating: tuple[int, _HFTokenizer] | None = None
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def from_dir(model: str | Path, flag: str = "--model") -> Tokenizer:
        """The tokenizer of checkpoint ``model`` (a directory, or a GGUF file): its
        directory's ``tokenizer.json`` if there is one, else the GGUF metadata
        (:mod:`model_shards.gguf.tokenizer`); ``ValueError`` naming ``flag`` if neither works."""
        path = Path(model)
        directory = path.parent if path.is_file() else path
        if (directory / "tokenizer.json").is_file():
            return Tokenizer._from_tokenizer_json(directory)
        if not is_gguf(path):
            raise ValueError(f"{flag} {model}: no tokenizer.json in that directory, and no GGUF")
        backend, config = tokenizer_from_gguf(gguf_files(path)[0])
        return Tokenizer(backend, config)

    @staticmethod
    def _from_tokenizer_json(model_dir: Path) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: cannot load tokenizer ({exc})") from exc
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{config_path}: not valid JSON ({exc})") from exc
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else None
        return Tokenizer(backend, config, template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @ttft_trace.span("tokenize_start", "tokenized")
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids, special tokens added exactly as transformers adds them.

        A rendered chat template already holds its special tokens: encode it with
        ``add_special_tokens=False``, as ``apply_chat_template`` does. Releases the GIL while
        it works (``encode_batch``; ``encode`` would hold it), so a long text tokenized in a
        thread leaves the event loop running.
        """
        return self.encode_many([text], add_special_tokens=add_special_tokens)[0]

    def encode_many(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` of each of ``texts``, in one call that releases the GIL."""
        encodings = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (a token never covers more text, but
        an unknown-word token and normalizers can: see :mod:`server.api.input_limits`)."""
        return max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=1)

    def encode_truncated(self, text: str, max_tokens: int) -> list[int]:
        """Ids with special tokens, the text cut so the whole fits ``max_tokens`` (as
        transformers' ``truncation=True, max_length=max_tokens`` does); no padding."""
        return list(self._truncator(max_tokens).encode_batch([text])[0].ids)

    def encode_pair(
        self, first: str, second: str, max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]:
        """``(ids, token_type_ids)`` of a text pair, special tokens added by the tokenizer's
        post-processor (BERT: ``[CLS] first [SEP] second [SEP]``, types 0 then 1), as
        transformers' ``tokenizer(first, second)`` gives them; with ``max_tokens``, truncated
        as ``truncation=True, max_length=max_tokens`` does (longest first)."""
        backend = self._backend if max_tokens is None else self._truncator(max_tokens)
        encoding = backend.encode_batch([(first, second)])[0]
        return list(encoding.ids), list(encoding.type_ids)

    def _truncator(self, max_tokens: int) -> _HFTokenizer:
        """A copy of the backend that truncates to ``max_tokens`` (longest first), kept for
        the last ``max_tokens`` asked."""
        if self._truncating is None or self._truncating[0] != max_tokens:
            backend = _HFTokenizer.from_str(self._backend.to_str())
            backend.no_padding()
            backend.enable_truncation(max_tokens)
            self._truncating = (max_tokens, backend)
        return self._truncating[1]

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (for logprobs); ``""`` if unknown.

        A token holding part of a multi-byte character decodes to ``\ufffd``.
        """
        text = self._token_texts.get(token_id)
        if text is None:
            text = ""
            if 0 <= token_id < self.vocab_size:
                text = str(self._backend.decode([token_id], skip_special_tokens=False))
            self._token_texts[token_id] = text
        return text

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens and out-of-vocabulary ids skipped."""
        valid = [t for t in token_ids if 0 <= t < self.vocab_size]
        return str(self._backend.decode(valid, skip_special_tokens=True))
