"""A checkpoint's per-layer FP8 K/V scales, and the KV pools' dtype.

A compressed-tensors checkpoint with a ``kv_cache_scheme`` (``config/quantization.py``) stores
one scale per decoder layer for K and one for V, one value each, under any of these names
(``P`` = ``….layers.{i}.self_attn``):

* ``P.k_scale``, ``P.v_scale`` (compressed-tensors, vLLM);
* ``P.k_proj.output_scale``, ``P.v_proj.output_scale`` (older compressed-tensors);
* ``P.k_proj.k_scale``, ``P.v_proj.v_scale`` (ModelOpt);
* ``P.kv_scale``: one scale for both (vLLM's older FP8 checkpoints).

:class:`KVScaleStore` takes them out of the tensors the loader sees (they are no parameter);
:func:`set_pool_scales` gives them to an FP8 pool (``PagedKVCache.set_kv_scales``), which then
holds ``e4m3(k / k_scale)`` and ``e4m3(v / v_scale)``. With float pools they are not used (logged).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch

from model_shards.backends import Backend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.worker.checkpoint import CheckpointError, StoreView, TensorStore
from model_shards.worker.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

_SCALE = re.compile(
    r"\.layers\.(?P<layer>\d+)\.(?:[^.]+\.)?"
    r"(?P<role>k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale"
    r"|k_proj\.k_scale|v_proj\.v_scale)$"
)
_ROLES = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv"}
_ROLES |= {"k_proj.output_scale": "k", "v_proj.output_scale": "v"}
_ROLES |= {"k_proj.k_scale": "k", "v_proj.v_scale": "v"}


class KVScaleStore(StoreView):
    """``store`` (a :class:`~model_shards.worker.checkpoint.TensorStore`) without its K/V scale
    tensors, which :meth:`read` reads by layer."""

    def __init__(self, store: TensorStore) -> None:
        super().__init__(store)
        self.scales: dict[int, dict[str, str]] = {}  # layer → "k" | "v" | "kv" → tensor name
        self.plain: list[str] = []
        for name in store.names():
            match = _SCALE.search(name)
            if match is None:
                self.plain.append(name)
                continue
            roles = self.scales.setdefault(int(match["layer"]), {})
            role = _ROLES[match["role"]]
            if role in roles:
                raise CheckpointError(f"tensors {roles[role]!r} and {name!r}: two {role} scales")
            roles[role] = name

    def names(self) -> Iterator[str]:
        yield from self.plain

    def _value(self, name: str) -> float:
        src = self.store.source(name)
        value = src.read().float().reshape(-1)
        if value.numel() != 1:
            raise CheckpointError(
                f"tensor {name!r}: shape {list(src.shape)}, expected one scale per layer "
                "(per-head or per-channel KV scales are not served)"
            )
        scale = float(value[0])
        if not scale > 0 or scale == float("inf"):
            raise CheckpointError(f"tensor {name!r}: KV scale {scale} is not a positive number")
        return scale

    def read(self, layers: range, required: bool = False) -> dict[int, tuple[float, float]]:
        """``(k_scale, v_scale)`` of each layer of ``layers`` the checkpoint has scales for
        (``required``: every layer, as a ``kv_cache_scheme`` says); ``CheckpointError`` naming
        the tensor when one is missing or not one positive value."""
        out: dict[int, tuple[float, float]] = {}
        for layer in layers:
            roles = self.scales.get(layer)
            if roles is None:
                if required:
                    raise CheckpointError(
                        f"layer {layer}: no k_scale/v_scale tensors, which the config's "
                        "quantization_config.kv_cache_scheme promises"
                    )
                continue
            if "kv" in roles:
                if "k" in roles or "v" in roles:
                    raise CheckpointError(f"tensor {roles['kv']!r}: beside separate k/v scales")
                both = self._value(roles["kv"])
                out[layer] = (both, both)
                continue
            missing = [r for r in ("k", "v") if r not in roles]
            if missing:
                have = next(iter(roles.values()))
                raise CheckpointError(f"tensor {have!r}: no {missing[0]}_scale beside it")
            out[layer] = (self._value(roles["k"]), self._value(roles["v"]))
        return out


def kv_pool_dtype(
    replica: ReplicaConfig, dtype: torch.dtype, ops: Backend, cfg: ModelConfig | None = None
) -> torch.dtype:
    """The KV pools' dtype: e4m3 with ``--kv-cache-dtype fp8`` (a backend holding FP8 pools
    only: ``ValueError`` naming the flag on any other), or with ``auto`` and a checkpoint whose
    ``kv_cache_scheme`` stores KV scales (where the backend and attention allow: else the
    model's, logged); otherwise the model's."""
    if replica.kv_cache_dtype == "fp8":
        if not ops.fp8_kv:
            raise ValueError(
                f"--kv-cache-dtype fp8: the {ops.name} backend keeps float K/V; drop the flag"
            )
        return torch.float8_e4m3fn
    if cfg is None or not cfg.kv_fp8_scales:
        return dtype
    if ops.fp8_kv and not cfg.kv_latent:
        log.info("kv_cache_scheme of the checkpoint: FP8 KV cache with its per-layer scales")
        return torch.float8_e4m3fn
    log.info(
        "kv_cache_scheme of the checkpoint: K/V kept in %s (%s), its KV scales unused",
        dtype,
        "latent attention" if cfg.kv_latent else f"the {ops.name} backend",
    )
    return dtype


def set_pool_scales(kv: PagedKVCache, scales: dict[int, tuple[float, float]]) -> None:
    """Each layer's checkpoint scales on its pool (FP8 pools; float pools: unused, logged)."""
    if not scales:
        return
    fp8 = next(iter(kv.pools.values())).k.dtype == torch.float8_e4m3fn
    if not fp8:
        log.info("the checkpoint's FP8 KV scales are unused: the KV cache is not FP8")
        return
    for layer, (k_scale, v_scale) in scales.items():
        if layer in kv.pools:
            kv.set_kv_scales(layer, k_scale, v_scale)
