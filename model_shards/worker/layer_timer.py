"""Per-layer-kind prefill timing for the opt-in TTFT trace (:mod:`.step_trace`).

While rank 0 runs a traced request's step, its worker attaches PyTorch forward hooks
to its stage's modules (:func:`timed`) and detaches them after the forward, so
an untraced step runs the model exactly as before (no hook, no extra Python per
layer). Each hooked module kind accumulates ``time.perf_counter_ns()`` between
its pre- and post-hook: ``embedding``, ``attention block`` (``self_attn``: QKV
GEMM, rope / KV write, attention, o_proj), ``MLP block`` (gate/up GEMM, SiLU-mul,
down), and ``norms`` (the layers' RMSNorms; the final norm runs with the LM head);
inside the blocks, ``attention GEMM`` / ``MLP GEMM`` (the parallel linears) and
``attention kernel``. The stamps are host times: exact on the cpu backend (synchronous
ops); on a GPU they are launch times.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_TOP = {"embed_tokens": "embedding"}
_IN_LAYER = {
    "self_attn": "attention block",
    "mlp": "MLP block",
    "input_layernorm": "norms",
    "post_attention_layernorm": "norms",
}
_INNER = {
    "qkv_proj": "attention GEMM",
    "o_proj": "attention GEMM",
    "attn": "attention kernel",
    "gate_up_proj": "MLP GEMM",
    "down_proj": "MLP GEMM",
}


def _kinds(model: Any) -> Iterator[tuple[nn.Module, str]]:
    """``(module, kind)`` for every timed module of ``model`` (a ``*ForCausalLM``)."""
    for name, mod in model.named_modules():
        parts = name.split(".")
        if name == "model.embed_tokens":
            yield mod, _TOP[parts[-1]]
        elif len(parts) == 4 and parts[1] == "layers" and parts[3] in _IN_LAYER:
            yield mod, _IN_LAYER[parts[3]]
        elif len(parts) == 5 and parts[1] == "layers" and parts[4] in _INNER:
            yield mod, _INNER[parts[4]]


PREFIX = "layer:"  # step-stamp keys holding a kind's duration (ns), not a time


@contextmanager
def timed(model: Any, totals: dict[str, int]) -> Iterator[None]:
    """Within the block, add each timed module kind's forward time (ns) to ``totals``."""
    handles = []
    for mod, kind in _kinds(model):
        starts: list[int] = []

        def pre(_m: nn.Module, _a: object, starts: list[int] = starts) -> None:
            starts.append(time.perf_counter_ns())

        def post(
            _m: nn.Module, _a: object, _o: object, starts: list[int] = starts, kind: str = kind
        ) -> None:
            totals[kind] = totals.get(kind, 0) + time.perf_counter_ns() - starts.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
