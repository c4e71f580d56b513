"""GGML block-quantized weights: the formats, their reference (de)quantization in torch.

A leaf package (torch only): layers hold these tensors, backends compute with them.

- ``formats``: the GGML type table (codes, block sizes), the ``--quantization`` methods
- ``weights``: ``QuantizedTensor`` (one type's blocks) and ``QuantizedWeight`` (a layer's
  ``[out, in]`` weight as row segments, possibly of mixed types)
- ``dequantize``: blocks → float32 for every type we serve, bit for bit ``gguf.quants``'
- ``quantize``: float → Q8_0 / Q4_0 blocks (``--quantization``), bit for bit ``gguf.quants``'
- ``int4``: ``Int4GroupWeight``, the holder AWQ / GPTQ / compressed-tensors W4A16 checkpoints
  unpack to (4-bit groups along the input, nibbles two per byte), its reference dequantization
- ``fp8``: ``Fp8Weight`` (e4m3 weights, per-channel scales), the W8A8 activation rounding and
  ``--quantization fp8``'s weight quantizer
- ``int4_packing``: the int32 words 4-bit checkpoints pack values in (AWQ's order too)
- ``checkpoint_weight``: ``CheckpointWeight``, a layer's weight as row parts of those holders
- ``int4_ggml``: 4-bit groups as Q4_0 / Q4_1 blocks (the CPU kernels), when and how exactly
- ``panels``: the row-panel layout (sixteen rows' blocks interleaved, a byte permutation) that
  the CPU backend lays weights out in after loading
"""
