"""A grammar compile worker: one process that rank 0 can kill (``python -m`` this module).

``python -m model_shards.engine.structured.compile_worker MODEL_DIR VOCAB_SIZE EOS_ID...``
builds ``xgrammar``'s view of the vocabulary
(:func:`model_shards.engine.structured.grammars.tokenizer_info`), answers with an empty
:class:`~model_shards.messages.CompiledGrammar` (ready; or its ``error``, then exits), then
compiles each :class:`~model_shards.messages.GrammarSpec` read from stdin and writes the
result to stdout, frames as in :func:`write_frame`. It exits when stdin closes, and when
its parent dies (Linux: the parent-death signal).
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys
from typing import Any, BinaryIO

import msgspec

from model_shards.messages import CompiledGrammar, GrammarSpec, decode_grammar_spec, encode

_LENGTH = struct.Struct(">I")


def write_frame(out: BinaryIO, message: msgspec.Struct) -> None:
    """``message`` msgpack-encoded, after its length (4 bytes, big-endian)."""
    payload = encode(message)
    out.write(_LENGTH.pack(len(payload)) + payload)
    out.flush()


def read_frame(source: BinaryIO) -> bytes | None:
    """The next frame's payload, or ``None`` at end of input."""
    head = source.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    payload = source.read(length)
    return payload if len(payload) == length else None


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """``spec`` compiled by ``compiler`` (an ``xgrammar.GrammarCompiler``)."""
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.spec, any_whitespace=False)
    if spec.kind == "json_object":
        schema = {"type": "object"}
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    return compiler.compile_grammar(spec.spec)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent is already gone
        sys.exit(0)


def main(argv: list[str]) -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the frames
    model_dir, vocab_size, *eos = argv
    try:
        import xgrammar

        from model_shards.engine.structured.grammars import tokenizer_info

        info = tokenizer_info(model_dir, int(vocab_size), [int(t) for t in eos])
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    except Exception as exc:
        write_frame(out, CompiledGrammar(error=str(exc)))
        return
    write_frame(out, CompiledGrammar())
    while (payload := read_frame(sys.stdin.buffer)) is not None:
        spec = decode_grammar_spec(payload)
        try:
            compiled = compile_spec(compiler, spec)
        except Exception as exc:  # xgrammar raises RuntimeError with C++ context
            write_frame(
                out, CompiledGrammar(error=f"the {spec.kind} grammar does not compile: {exc}")
            )
        else:
            write_frame(out, CompiledGrammar(compiled.serialize_json()))


if __name__ == "__main__":
    main(sys.argv[1:])
