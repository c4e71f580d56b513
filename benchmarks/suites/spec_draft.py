"""Draft models for the speculative-decoding rows, written from the target's GGUF.

:func:`write_draft` keeps the target's metadata (so its tokenizer and chat template: the
draft passes ``--speculative-config``'s same-tokenizer check) with ``block_count`` layers:

* ``seed`` given: every weight drawn anew (matrices ``N(0, 0.02)`` in F16, norms 1), a draft
  "distilled from nothing": it shares nothing with the target but the shape and the vocabulary,
  so its acceptance is what chance gives;
* ``seed`` ``None``: the target's own embeddings, first ``layers`` blocks and final norm, their
  blocks copied as stored (an early-exit draft: the target cut after ``layers`` layers).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

WEIGHT_STD = 0.02


def write_draft(target: Path, out: Path, layers: int, seed: int | None) -> Path:
    """Write the draft GGUF of ``layers`` layers (see the module docstring) to ``out`` once
    (an existing file is kept); returns ``out``."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(target)
    arch = str(reader.fields["general.architecture"].contents())
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = layers if f.name == f"{arch}.block_count" else f.contents()
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        if seed is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order: rows first
        if len(shape) == 1:
            writer.add_tensor(t.name, np.ones(shape, dtype=np.float32))
        else:
            writer.add_tensor(t.name, rng.normal(0.0, WEIGHT_STD, shape).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    return out
