"""Text ↔ token ids for one checkpoint, with the ``tokenizers`` library only.

Contract: :meth:`Tokenizer.encode` returns the ids
``transformers.AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`` returns
for the same directory. With ``tokenizer.json`` present, transformers >= 5
takes special tokens from that file's post-processor (a BOS it adds is added
once, here too) and drops ``add_bos_token``/``add_eos_token`` from
``tokenizer_config.json``; we do the same, so no BOS is ever doubled. From
``tokenizer_config.json`` we read the BOS/EOS token strings.

:meth:`Tokenizer.decode` skips special tokens and ids outside the vocabulary
(an engine's embedding table may be padded past it). Text cleanup
(``clean_up_tokenization_spaces``) is not applied, as in vLLM's streaming path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer


def _token_string(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` plus ``tokenizer_config.json``."""

    def __init__(self, backend: _HFTokenizer, config: dict[str, Any] | None = None) -> None:
        self._backend = backend
        config = config or {}
        self.bos_token = _token_string(config.get("bos_token"))
        self.eos_token = _token_string(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def from_dir(model_dir: str | Path) -> Tokenizer:
        """Load ``model_dir/tokenizer.json``; raise ``ValueError`` naming the file if unusable."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"--model {model_dir}: no tokenizer.json in that directory")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: cannot load tokenizer ({exc})") from exc
        config_path = Path(model_dir) / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{config_path}: not valid JSON ({exc})") from exc
        return Tokenizer(backend, config)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Prompt ids, special tokens added exactly as transformers adds them."""
        return list(self._backend.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens and out-of-vocabulary ids skipped."""
        valid = [t for t in token_ids if 0 <= t < self.vocab_size]
        return str(self._backend.decode(valid, skip_special_tokens=True))
