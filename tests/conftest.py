"""Test-wide settings: nothing may reach a model hub; without a GPU, Triton kernels run in
Triton's interpreter on CPU tensors (``triton.jit`` reads the variable when a kernel is
defined, so it is set before any test module imports one)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# fixtures shared across test folders (used by name)
pytest_plugins = ["tests.server.cli.spawn_guard"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The references (transformers on CPU, tiny models) gain nothing past a few threads, and on a
# large VM every op's OpenMP barrier over all its vCPUs costs more than the op: on the H200
# host (16 vCPUs) the family parity fixture's references took 259 s against 23 s on 2 cores.
torch.set_num_threads(min(torch.get_num_threads(), 4))


@pytest.fixture(autouse=True, scope="session")
def _interpreter_loop_bounds() -> Iterator[None]:
    """triton 3.6's interpreter takes a runtime loop bound as ``int(array of shape (1,))``,
    which numpy >= 2.4 rejects (triton-lang/triton#9171); reshape it to 0-d. Compiled
    kernels are unaffected."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch)
        yield
