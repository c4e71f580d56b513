"""Rank 0's grammar compiler: one compile per distinct grammar, never on the step loop.

:class:`GrammarCache` compiles :class:`~model_shards.messages.GrammarSpec` values with
``xgrammar`` against the served checkpoint's vocabulary, in worker processes with a
deadline (:mod:`.compile_pool`), loads each result in rank 0, and keeps the last
``capacity`` compiled grammars, or their errors (an LRU keyed by ``(kind, spec)``; a spec's
text is canonical, see :mod:`server.api.structured`). Asking for a grammar being compiled
returns the same future, so sixteen requests with one schema compile it once, and a grammar
that timed out fails again at once.

The vocabulary comes from ``model_dir/tokenizer.json`` or a GGUF's metadata (read by each
worker, and by rank 0 when the first compiled grammar is loaded), sized to the model's logits
(``vocab_size``, which may be padded past the tokenizer); added special tokens are given
empty text so no grammar can ever produce them; the model's EOS ids are the grammar's stop
tokens.
JSON is generated compact (no free whitespace): a weak model cannot stall in spaces.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_shards.engine.structured.compile_pool import COMPILE_TIMEOUT_S, CompilePool, GrammarError
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
    """Compiled grammars by spec, compiled in worker processes (module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        eos_token_ids: list[int],
        capacity: int = DEFAULT_CAPACITY,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._capacity = capacity
        self._futures: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._pool = CompilePool(model_dir, vocab_size, self._eos, timeout_s=compile_timeout_s)
        self._info: Any = None  # xgrammar.TokenizerInfo, to load compiled grammars with
        self._lock = threading.Lock()
        self.num_compiled = 0

    def get(self, spec: GrammarSpec) -> Future[Any]:
        """The future of ``spec``'s compiled grammar (an ``xgrammar.CompiledGrammar``);
        it raises :class:`GrammarError` when the grammar does not compile (in time)."""
        key = (spec.kind, spec.spec)
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
            return future
        future = Future()
        self._pool.submit(spec).add_done_callback(lambda done: self._load(done, future))
        self._futures[key] = future
        while len(self._futures) > self._capacity:
            self._futures.popitem(last=False)
        return future

    def _load(self, compiled: Future[str], future: Future[Any]) -> None:
        """``future`` gets the grammar ``compiled`` (serialized) holds, or its error."""
        exc = compiled.exception()
        if exc is not None:
            future.set_exception(exc)
            return
        try:
            import xgrammar

            with self._lock:
                if self._info is None:
                    self._info = tokenizer_info(self._model_dir, self._vocab_size, self._eos)
            grammar = xgrammar.CompiledGrammar.deserialize_json(compiled.result(), self._info)
        except Exception as exc:
            future.set_exception(GrammarError(f"cannot load the compiled grammar: {exc}"))
            return
        self.num_compiled += 1
        future.set_result(grammar)

    def close(self) -> None:
        self._pool.close()
