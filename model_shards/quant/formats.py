"""The GGML block formats we serve: their type codes and block sizes.

A GGML tensor of type ``t`` stores each row of ``cols`` values as ``cols / block_size(t)``
consecutive blocks of ``type_size(t)`` bytes (block layouts: :mod:`.dequantize`). Rows are
independent, so any row range is a slice of whole rows, and a column range is a slice of
whole blocks when it starts and ends on a block boundary.
"""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    """``gguf.GGMLQuantizationType`` values of the types we serve."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# type -> (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
BLOCK_TYPES = frozenset(BLOCK_SIZES) - FLOAT_TYPES  # the block-quantized ones
# --quantization NAME -> the type layers quantize dense weights to at load
QUANTIZATION_METHODS: dict[str, GGMLType] = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
# ... and the type of the vocabulary table (embedding, and the LM head it may be tied to):
# never below 8 bits, as llama-quantize keeps the output tensor at Q6_K or better, since the
# logits are what every error ends in; with fp8 it stays dense, as vLLM keeps the LM head
VOCAB_QUANTIZATION: dict[str, str] = {"q8_0": "q8_0", "q4_0": "q8_0", "fp8": "dense"}


def ggml_type(value: int) -> GGMLType | None:
    """The served type of a ``gguf.GGMLQuantizationType`` value; ``None``: not one we serve."""
    try:
        return GGMLType(value)
    except ValueError:
        return None


def block_size(qtype: GGMLType) -> int:
    return BLOCK_SIZES[qtype][0]


def row_bytes(qtype: GGMLType, cols: int) -> int:
    """Bytes of one row of ``cols`` values; ``ValueError`` unless whole blocks."""
    elems, nbytes = BLOCK_SIZES[qtype]
    if cols % elems:
        raise ValueError(f"{qtype.name} rows hold multiples of {elems} values, not {cols}")
    return cols // elems * nbytes
