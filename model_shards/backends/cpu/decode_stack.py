"""The cpu backend's whole-step decode (``Backend.decode_stack``): a stack's plain layers
handed once to ``torch.classes.shardserve_cpu.DecodeStack`` (``kernels/decode_stack.cpp``),
which runs a decode step through all of them in one call with the kernels the modules call,
in their order: the same bits, without ~45 Python op calls a layer.

Each linear layer becomes segments of output rows, each multiplied as the backend's
``quantized_linear`` or ``linear`` would: GGML blocks as row panels or not, our packed GEMM,
or ``F.linear`` on the dense weight. A layer it cannot take so (oneDNN's packed layout, float
segments of a quantized weight, a bias over rows no segment covers) leaves the stack to the
modules (``None``). ``SHARDSERVE_DECODE_STACK=0`` switches it off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from model_shards.backends.cpu.packed_gemm import PackedGemm
from model_shards.backends.decode_stack import DecodeLayerParts, GemmParts
from model_shards.quant.formats import FLOAT_TYPES
from model_shards.worker.kv_cache import KVPool

ENV_VAR = "SHARDSERVE_DECODE_STACK"
# kernels/decode_stack.cpp's SegmentKind
PANELS, BLOCKS, PACKED, DENSE = 0, 1, 2, 3

Segment = tuple[torch.Tensor, int, int, int, int]  # data, kind, GGML type, start, end


class CpuDecodeStack:
    """:class:`~model_shards.backends.decode_stack.DecodeStack` over the native object."""

    def __init__(self, native: torch.ScriptObject) -> None:
        self._native = native

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        pools: Sequence[KVPool],
    ) -> torch.Tensor:
        k = [p.k for p in pools]
        v = [p.v for p in pools]
        block_size = pools[0].block_size
        forward = self._native.forward  # type: ignore[attr-defined]
        return forward(
            x, positions, cos, sin, slot_mapping, block_tables, context_lens, block_size, k, v
        )


def build_decode_stack(
    layers: list[DecodeLayerParts], environ: Mapping[str, str] = os.environ
) -> CpuDecodeStack | None:
    """The native stack of ``layers``, or ``None`` where a layer cannot be taken (the module
    docstring)."""
    if environ.get(ENV_VAR, "1") == "0" or not layers:
        return None
    first = layers[0]
    shape = (first.eps, first.num_heads, first.num_kv_heads, first.head_dim, first.scale)
    native = torch.classes.shardserve_cpu.DecodeStack(*shape)
    for layer in layers:
        if (layer.eps, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale) != shape:
            return None
        q_norm, k_norm = (None if n is None else n.detach() for n in (layer.q_norm, layer.k_norm))
        native.add_layer(layer.input_norm.detach(), layer.post_norm.detach(), q_norm, k_norm)
        for which, parts in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
            segments = _segments(parts)
            if segments is None:
                return None
            out = parts.quant.out_features if parts.quant is not None else parts.weight.shape[0]
            for data, kind, qtype, start, end in segments:
                native.add_segment(which, data, kind, qtype, start, end, out)
            if parts.bias is not None:
                native.set_bias(which, parts.bias.detach(), False)
            if parts.bias_after is not None:
                native.set_bias(which, parts.bias_after.detach(), True)
    return CpuDecodeStack(native)


def _segments(parts: GemmParts) -> list[Segment] | None:
    """``parts`` as the native stack's segments, or ``None`` where it has no way to take them."""
    quant = parts.quant
    if quant is not None:
        if parts.bias is not None and not quant.covers_all:
            return None
        segments = []
        for seg in quant.segments:
            t = seg.tensor
            if t.qtype in FLOAT_TYPES:
                return None
            kind = PANELS if t.panels else BLOCKS
            segments.append((t.data, kind, int(t.qtype), seg.start, seg.end))
        return segments
    weight, packed = parts.weight.detach(), parts.packed
    out = weight.shape[0]
    if packed is None:
        return [(weight, DENSE, 0, 0, out)]
    if isinstance(packed, PackedGemm) and packed.out_features:  # our GEMM's panels
        return [(packed.data, PACKED, 0, 0, out)]
    return None  # oneDNN's layout
