"""Sharded layers against their unsharded tensors: a full tensor read like a checkpoint's,
and a rank's shard context."""

from __future__ import annotations

from dataclasses import replace

import torch

from model_shards.backends import Backend, ReferenceBackend
from model_shards.layers.context import ShardContext
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.quant.dequantize import dequantize
from model_shards.quant.formats import BLOCK_SIZES, GGMLType
from model_shards.quant.quantize import quantize


class FullTensor:
    """A checkpoint tensor held in memory, read like :class:`TensorSource`."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name, self.tensor = name, tensor
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype

    def read(self, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = self.shape[dim] if end is None else end
        return self.tensor.narrow(dim, start, end - start).clone()


def shard_context(
    rank: int, tp: int, ops: Backend | None = None, quantization: str | None = None
) -> ShardContext:
    ps = replace(single_process_state(), tp_rank=rank, tp_size=tp)
    ops = ReferenceBackend() if ops is None else ops
    return ShardContext(Comm(ps), ops, torch.float32, quantization=quantization)


class BlockTensor(FullTensor):
    """A GGUF tensor held in memory: ``ggml_type``, ``read`` (dequantized float32) and
    ``read_blocks`` (raw blocks), as the GGUF reader's sources."""

    def __init__(self, name: str, blocks: torch.Tensor, qtype: GGMLType, cols: int) -> None:
        super().__init__(name, dequantize(blocks, qtype, cols))
        self.blocks, self.ggml_type, self.block = blocks, int(qtype), BLOCK_SIZES[qtype]

    def read_blocks(
        self, row_start: int, row_end: int, col_start: int = 0, col_end: int | None = None
    ) -> torch.Tensor:
        col_end = self.shape[1] if col_end is None else col_end
        elems, nbytes = self.block
        assert col_start % elems == 0 and col_end % elems == 0
        cols = slice(col_start // elems * nbytes, col_end // elems * nbytes)
        return self.blocks[row_start:row_end, cols].clone()


def random_blocks(qtype: GGMLType, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Blocks of ``qtype`` quantizing normal values the way llama.cpp's files do: well-formed
    scales (the K-quants' from gguf's reference quantizer where it has one, else random
    bytes with a small float16 scale), so dequantized values are weights' size."""
    gen = torch.Generator().manual_seed(seed)
    if qtype in (GGMLType.Q8_0, GGMLType.Q4_0):
        return quantize(torch.randn(rows, cols, generator=gen) * 0.05, qtype)
    elems, nbytes = BLOCK_SIZES[qtype]
    data = torch.randint(0, 256, (rows * cols // elems, nbytes), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(data.shape[0], 1, generator=gen) * 0.004 + 0.001).half().view(torch.uint8)
    offsets = {GGMLType.Q6_K: (208,)}.get(qtype, (0, 2) if qtype != GGMLType.Q5_0 else (0,))
    for off in offsets:
        data[:, off : off + 2] = scale
    return data.reshape(rows, -1)
