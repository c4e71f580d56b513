"""The ``compressed-tensors`` library's own decompression of one weight (the library that writes
these checkpoints; a test dependency), for ``test_quant_sources.py``."""

from __future__ import annotations

from typing import Any

import torch


def decompress(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``tensors`` (``weight_packed``, ``weight_scale``, … by suffix) of one weight of a
    ``quantization_config`` with one scheme → the library's dequantized ``[N, K]``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    (scheme,) = config["config_groups"].values()
    compressor = BaseCompressor.load_from_registry(config["format"])
    # scales in float32, so that the library's arithmetic is float32 as ours (it computes in
    # the scale's dtype)
    data = dict(tensors)
    data["weight_scale"] = data["weight_scale"].float()
    out = compressor.decompress(data, QuantizationScheme(**scheme))
    return out["weight"]
