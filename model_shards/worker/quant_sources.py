"""A quantized checkpoint's tensors as one source per quantized weight (AWQ, GPTQ,
compressed-tensors, FBGEMM FP8; the formats: ``model_shards/config/quantization.py``).

:class:`QuantizedStore` wraps a :class:`~model_shards.worker.checkpoint.Checkpoint`: the tensors of
one quantized linear (``P.qweight``, ``P.qzeros``, ``P.scales``, …) become one source named
``P.weight``, of the dense shape ``[N, K]``, so model files and the loader see the names of a
dense checkpoint. A layer reads its slice with :meth:`Int4Source.read_quantized` (an
:class:`~model_shards.quant.int4.Int4GroupWeight` or :class:`~model_shards.quant.fp8.Fp8Weight`
of its rows or columns, only those bytes read), or dequantized with ``read`` (a module that keeps
its weights dense: MoE experts, ``keep_dense`` matrices). Stored layouts, ``W [N, K]``:

* AWQ: ``qweight`` int32 ``[K, N/8]``, nibble ``i`` of word ``j`` = column
  ``8j + [0,2,4,6,1,3,5,7][i]``; ``qzeros`` int32 ``[K/G, N/8]`` the same; ``scales [K/G, N]``;
  ``W = (q - z) s``.
* GPTQ: ``qweight`` int32 ``[K/8, N]``, nibble ``i`` of word ``j`` = input ``8j + i``; ``qzeros``
  int32 ``[K/G, N/8]`` along N (``checkpoint_format`` gptq: ``z - 1`` stored); ``scales [K/G, N]``;
  ``g_idx [K]`` (``desc_act``: each input's group).
* compressed-tensors pack-quantized: ``weight_packed`` int32 ``[N, K/8]`` along K of ``q + 8``
  (``q`` signed), ``weight_scale [N, K/G]``, ``weight_zero_point`` int32 ``[N/8, K/G]`` along N of
  ``z + 8`` (asymmetric only), ``weight_shape = [N, K]``; ``W = (q - z) s``.
* FP8: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` ``[N, 1]`` or one value,
  ``input_scale`` (static activations) one value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import cache

import torch

from model_shards.config.quantization import CheckpointQuant
from model_shards.quant.checkpoint_weight import CheckpointPart
from model_shards.quant.fp8 import Fp8Weight
from model_shards.quant.int4 import Int4GroupWeight
from model_shards.quant.int4_packing import pack_nibbles, unpack_int32
from model_shards.worker.checkpoint import CheckpointError, StoreView, TensorSource, TensorStore

log = logging.getLogger(__name__)

# each layout's tensors of one weight: (the one that names it, the others: required, optional)
_TENSORS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "awq": ("qweight", ("qzeros", "scales"), ()),
    "gptq": ("qweight", ("qzeros", "scales"), ("g_idx",)),
    "ct-int4": ("weight_packed", ("weight_scale", "weight_shape"), ("weight_zero_point",)),
    "fp8": ("weight_scale", ("weight",), ("input_scale", "input_scale_ub")),
}


@cache
def _log_once(message: str) -> None:
    log.info(message)


class QuantSource(TensorSource):
    """A quantized weight's tensors (``parts``: suffix → source) as the dense ``[N, K]``."""

    def __init__(
        self,
        prefix: str,
        parts: dict[str, TensorSource],
        quant: CheckpointQuant,
        shape: tuple[int, int],
    ) -> None:
        main = parts[_TENSORS[quant.layout][0]]
        super().__init__(main.entry, main._checkpoint)
        self.prefix, self.parts, self.quant, self._shape = prefix, parts, quant, shape

    @property
    def name(self) -> str:
        return f"{self.prefix}.weight"

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def read_quantized(
        self, dim: int = 0, start: int = 0, end: int | None = None
    ) -> CheckpointPart:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``start:end`` of ``W``, held quantized."""
        raise NotImplementedError

    def read(self, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The slice dequantized (float32): for modules that keep their weights dense."""
        _log_once(
            f"{self.quant.method} weights of dense modules (MoE experts…) dequantized at load"
        )
        end = self._shape[dim] if end is None else end
        try:
            return self.read_quantized(dim, start, end).dequantize()
        except CheckpointError:  # not on a group boundary: the whole matrix, then the slice
            return self.read_quantized().dequantize().narrow(dim, start, end - start)

    def _check_range(self, dim: int, start: int, end: int) -> None:
        if not 0 <= start <= end <= self._shape[dim]:
            raise CheckpointError(
                f"tensor {self.name!r}: slice {start}:{end} of dim {dim} out of range "
                f"{list(self._shape)}"
            )


Span = tuple[int, int]


def _read_2d(src: TensorSource, rows: Span, cols: Span) -> torch.Tensor:
    """``src[rows, cols]`` of a 2-D tensor, reading only the split dimension's range."""
    if len(src.shape) != 2:
        raise CheckpointError(f"tensor {src.name!r}: shape {list(src.shape)}, expected 2-D")
    if cols == (0, src.shape[1]):
        return src.read(0, *rows)
    return src.read(1, *cols)[rows[0] : rows[1]]


def _read_words(
    src: TensorSource, packed_dim: int, values: Span, other: Span, awq: bool = False
) -> torch.Tensor:
    """uint8 values ``values`` along ``packed_dim`` (eight per int32 word) × ``other`` along
    the other dimension of ``src``, in its orientation."""
    if src.dtype != torch.int32:
        raise CheckpointError(f"tensor {src.name!r}: dtype {src.dtype}, expected int32 words")
    a, b = values
    words = (a // 8, -(-b // 8))
    span = (words, other) if packed_dim == 0 else (other, words)
    vals = unpack_int32(_read_2d(src, *span), packed_dim, awq)
    return vals.narrow(packed_dim, a - 8 * words[0], b - a)


def group_span(name: str, cols: Span, k: int, group_size: int, act_order: bool) -> tuple[Span, int]:
    """The groups input columns ``cols`` of ``k`` fall in, and their group size; a split not on
    a group boundary is a ``CheckpointError`` naming the tensor-parallel sizes that are."""
    a, b = cols
    if act_order:  # every group may have columns anywhere: keep them all
        return (0, -(-k // group_size)), group_size
    if group_size >= k:
        return (0, 1), max(b - a, 1)
    if a % group_size or (b % group_size and b != k):
        valid = [t for t in range(1, 65) if k % t == 0 and (k // t) % group_size == 0]
        raise CheckpointError(
            f"tensor {name!r}: groups of {group_size} input columns cannot be split at columns "
            f"{a}:{b}; tensor-parallel sizes that split its {k} columns on group boundaries: "
            f"{valid}"
        )
    return (a // group_size, -(-b // group_size)), group_size


class Int4Source(QuantSource):
    """AWQ, GPTQ and compressed-tensors pack-quantized weights."""

    @property
    def group_size(self) -> int:
        g = self.quant.group_size
        return self._shape[1] if g == -1 else g

    def read_quantized(
        self, dim: int = 0, start: int = 0, end: int | None = None
    ) -> CheckpointPart:
        n, k = self._shape
        end = self._shape[dim] if end is None else end
        self._check_range(dim, start, end)
        rows = (start, end) if dim == 0 else (0, n)
        cols = (start, end) if dim == 1 else (0, k)
        g_idx = self._g_idx()
        groups, group_size = group_span(self.name, cols, k, self.group_size, g_idx is not None)
        if self.quant.layout == "awq":  # [K, N/8] along N
            q = _read_words(self.parts["qweight"], 1, rows, cols, awq=True).t()
        elif self.quant.layout == "gptq":  # [K/8, N] along K
            q = _read_words(self.parts["qweight"], 0, cols, rows).t()
        else:  # [N, K/8] along K
            q = _read_words(self.parts["weight_packed"], 1, cols, rows)
        scales, zeros = self._scales_zeros(rows, groups)
        local_g_idx = None if g_idx is None else g_idx[cols[0] : cols[1]].contiguous()
        return Int4GroupWeight(pack_nibbles(q), scales, zeros, group_size, local_g_idx)

    def _scales_zeros(self, rows: Span, groups: Span) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``scales [n, g]`` and ``zeros [n, g]`` uint8 (``None``: symmetric) of ``rows``."""
        if self.quant.layout == "ct-int4":
            scales = _read_2d(self.parts["weight_scale"], rows, groups).contiguous()
            zp = self.parts.get("weight_zero_point")
            if self.quant.symmetric or zp is None:
                return scales, None
            z = _read_words(zp, 0, rows, groups)  # [N/8, K/G] along N, z + 8
        else:
            scales = _read_2d(self.parts["scales"], groups, rows).t().contiguous()
            awq = self.quant.layout == "awq"
            z = _read_words(self.parts["qzeros"], 1, rows, groups, awq).t()  # [K/G, N/8]
            if self.quant.zeros_minus_one:
                z = z + 1  # 1..16, as exllama and vLLM read GPTQ v1 zeros
        if self.quant.symmetric and bool((z == 8).all()):
            return scales, None
        return scales, z.contiguous()

    def _g_idx(self) -> torch.Tensor | None:
        """GPTQ's ``g_idx`` when it is not ``k // group_size`` (act-order), else ``None``."""
        src = self.parts.get("g_idx")
        if src is None:
            return None
        g_idx = src.read().to(torch.int64)
        k = self._shape[1]
        groups = -(-k // self.group_size)
        if tuple(g_idx.shape) != (k,) or bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise CheckpointError(f"tensor {src.name!r}: expected [{k}] groups in 0..{groups - 1}")
        trivial = torch.arange(k) // self.group_size
        return None if torch.equal(g_idx, trivial) else g_idx


class Fp8Source(QuantSource):
    """compressed-tensors float-quantized and FBGEMM FP8 weights."""

    def read_quantized(
        self, dim: int = 0, start: int = 0, end: int | None = None
    ) -> CheckpointPart:
        n = self._shape[0]
        end = self._shape[dim] if end is None else end
        self._check_range(dim, start, end)
        weight = self.parts["weight"].read(dim, start, end)
        scale = self.parts["weight_scale"].read().float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(n).contiguous()
        if dim == 0:
            scale = scale[start:end].contiguous()
        input_scale = None
        if self.quant.static_input:
            src = self.parts.get("input_scale")
            if src is None:
                raise CheckpointError(f"tensor {self.prefix}.input_scale missing (static FP8)")
            input_scale = src.read().float().reshape(())
        return Fp8Weight(weight, scale, input_scale, self.quant.input_scale_ub)


def _dense_shape(
    quant: CheckpointQuant, prefix: str, parts: dict[str, TensorSource]
) -> tuple[int, int]:
    """``[N, K]`` of a quantized weight, from its stored tensors."""
    if quant.layout == "awq":
        k, n8 = parts["qweight"].shape
        return n8 * 8, k
    if quant.layout == "gptq":
        k8, n = parts["qweight"].shape
        return n, k8 * 8
    if quant.layout == "ct-int4":
        n, k = (int(v) for v in parts["weight_shape"].read().tolist())
        if tuple(parts["weight_packed"].shape) != (n, -(-k // 8)):
            raise CheckpointError(f"tensor {prefix}.weight_packed: shape does not fit [{n}, {k}]")
        return n, k
    n, k = parts["weight"].shape
    if parts["weight"].dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"tensor {prefix}.weight: {parts['weight'].dtype}, not float8_e4m3fn")
    return n, k


class QuantizedStore(StoreView):
    """A checkpoint's tensors with each quantized weight's as one :class:`QuantSource`
    (a :class:`~model_shards.worker.checkpoint.TensorStore`)."""

    def __init__(self, store: TensorStore, quant: CheckpointQuant) -> None:
        super().__init__(store)
        self.quant = quant
        main, required, optional = _TENSORS[quant.layout]
        names = set(store.names())
        self.weights: dict[str, tuple[str, ...]] = {}  # P.weight → the stored names it takes
        for name in sorted(names):
            prefix, _, suffix = name.rpartition(".")
            if suffix != main:
                continue
            taken = [f"{prefix}.{s}" for s in (main, *required)]
            missing = [t for t in taken if t not in names]
            if missing:
                raise CheckpointError(f"tensor(s) missing from checkpoint: {missing}")
            taken += [f"{prefix}.{s}" for s in optional if f"{prefix}.{s}" in names]
            self.weights[f"{prefix}.weight"] = tuple(taken)
        consumed = {t for taken in self.weights.values() for t in taken}
        self.plain = [n for n in names if n not in consumed]

    def names(self) -> Iterator[str]:
        yield from self.plain
        yield from self.weights

    def source(self, name: str) -> TensorSource:
        taken = self.weights.get(name)
        if taken is None:
            return self.store.source(name)
        prefix = name.removesuffix(".weight")
        parts = {t.removeprefix(f"{prefix}."): self.store.source(t) for t in taken}
        shape = _dense_shape(self.quant, prefix, parts)
        cls = Fp8Source if self.quant.layout == "fp8" else Int4Source
        return cls(prefix, parts, self.quant, shape)
