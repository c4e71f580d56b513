"""Rank 0's grammar compiler: one compile per distinct grammar, never on the step loop.

:class:`GrammarCache` compiles :class:`~model_shards.messages.GrammarSpec` values with
``xgrammar`` against the served checkpoint's vocabulary, in one background thread, and
keeps the last ``capacity`` compiled grammars (an LRU keyed by ``(kind, spec)``; a
spec's text is canonical, see :mod:`server.api.structured`). Asking for a grammar being
compiled returns the same future, so sixteen requests with one schema compile it once.

The vocabulary comes from ``model_dir/tokenizer.json`` or a GGUF's metadata (read in the
compile thread when the first grammar is asked for), sized to the model's logits
(``vocab_size``, which may be padded past the tokenizer); added special tokens are given
empty text so no grammar can ever produce them; the model's EOS ids are the grammar's stop tokens.
JSON is generated compact (no free whitespace): a weak model cannot stall in spaces.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_shards.messages import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

DEFAULT_CAPACITY = 256


def tokenizer_info(
    model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]
) -> xgrammar.TokenizerInfo:
    """xgrammar's view of ``model_dir/tokenizer.json`` (a GGUF checkpoint without one: its
    metadata's vocabulary, :mod:`model_shards.gguf.tokenizer`); ``ValueError`` naming the file."""
    import xgrammar
    from tokenizers import Tokenizer

    from model_shards.gguf.files import gguf_files, is_gguf
    from model_shards.gguf.tokenizer import tokenizer_from_gguf

    path = Path(model_dir) / "tokenizer.json"
    if is_gguf(model_dir):  # a tokenizer.json beside the GGUF wins, as in the frontend
        first = gguf_files(model_dir)[0]
        beside = first.parent / "tokenizer.json"
        path = beside if beside.is_file() else first
    try:
        tok = tokenizer_from_gguf(path)[0] if is_gguf(path) else Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise ValueError(
            f"{path}: cannot load the tokenizer for structured outputs ({exc})"
        ) from exc
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special:
            encoded[i] = ""
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgrammar.TokenizerInfo(
        encoded[:vocab_size],
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
        add_prefix_space=bool(meta["add_prefix_space"]),
    )


class GrammarCache:
    """Compiled grammars by spec, compiled in one background thread (module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        eos_token_ids: list[int],
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._capacity = capacity
        self._futures: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiler: Any = None
        self._lock = threading.Lock()
        self.num_compiled = 0

    def get(self, spec: GrammarSpec) -> Future[Any]:
        """The future of ``spec``'s compiled grammar (an ``xgrammar.CompiledGrammar``);
        it raises ``ValueError`` when the grammar does not compile."""
        key = (spec.kind, spec.spec)
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, spec)
        self._futures[key] = future
        while len(self._futures) > self._capacity:
            self._futures.popitem(last=False)
        return future

    def _compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = tokenizer_info(self._model_dir, self._vocab_size, self._eos)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            compiled = _compile(self._compiler, spec)
        except Exception as exc:  # xgrammar raises RuntimeError with C++ context
            raise ValueError(f"the {spec.kind} grammar does not compile: {exc}") from exc
        self.num_compiled += 1
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.spec, any_whitespace=False)
    if spec.kind == "json_object":
        schema = {"type": "object"}
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    return compiler.compile_grammar(spec.spec)
