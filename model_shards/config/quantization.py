"""A checkpoint's ``quantization_config`` (in ``config.json``), read into
:class:`CheckpointQuant`: the layout its quantized linear weights are stored in. Torch-free.

Served (the tensors of each layout: ``model_shards/worker/quant_sources.py``):

* ``awq``: ``version: gemm``, ``bits: 4``, ``zero_point: true``; ``qweight``/``qzeros``/``scales``;
* ``gptq``: ``bits: 4``, ``desc_act`` true or false, ``sym`` true or false,
  ``checkpoint_format`` ``gptq`` (zeros stored minus one) or ``gptq_v2``; ``group_size`` -1 is
  one group per row;
* ``compressed-tensors``: ``pack-quantized`` int4 weights (``strategy: group``, symmetric or
  not, no activations) and ``float-quantized`` FP8 e4m3 (``strategy`` channel or tensor;
  activations dynamic per token or static per tensor);
* ``fbgemm_fp8``: FP8 weights with per-channel scales, activations dynamic per token (each
  token's ``max |x|`` bounded by ``activation_scale_ub``).

A compressed-tensors ``kv_cache_scheme`` (:func:`parse_kv_cache_scheme`) is served when it is FP8
e4m3 with one stored scale per layer for K and one for V (``strategy: tensor``, static,
symmetric): the checkpoint's ``k_scale``/``v_scale`` tensors (``worker/kv_scales.py``) then
scale an FP8 KV cache. A kv_cache_scheme without ``config_groups``: the weights are dense.

Modules the config leaves dense (``ignore``, ``modules_to_not_convert``) are stored dense and
load as such: which module is quantized is read from the tensors themselves. Anything else is a
``ValueError`` naming the ``quantization_config`` field and its value, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Layout = Literal["awq", "gptq", "ct-int4", "fp8"]
#: --quantization methods that quantize a dense checkpoint as it loads: GGML blocks (CPU), FP8
QUANTIZATION_CHOICES: tuple[str, ...] = ("q8_0", "q4_0", "fp8")
CPU_ONLY_QUANTIZATION = frozenset({"q8_0", "q4_0"})


@dataclass(frozen=True)
class CheckpointQuant:
    """How a quantized checkpoint stores its linear weights.

    ``layout``: ``awq`` | ``gptq`` | ``ct-int4`` (compressed-tensors pack-quantized) | ``fp8``
    (compressed-tensors float-quantized and fbgemm_fp8: ``weight`` e4m3 and ``weight_scale``);
    ``method``: the ``quant_method`` as written; ``group_size``: int4 values per scale along the
    input (-1: the whole row); ``symmetric``: int4 without stored zeros; ``desc_act``: GPTQ's
    act-order (a ``g_idx`` per input column); ``zeros_minus_one``: GPTQ v1 stores ``zero - 1``;
    ``static_input``: FP8 activations scaled by the checkpoint's ``input_scale``;
    ``input_scale_ub``: FBGEMM's ``activation_scale_ub``, the bound of a token's ``max |x|``.
    """

    layout: Layout
    method: str
    group_size: int = 0
    symmetric: bool = True
    desc_act: bool = False
    zeros_minus_one: bool = False
    static_input: bool = False
    input_scale_ub: float | None = None

    @property
    def is_int4(self) -> bool:
        return self.layout != "fp8"


class _Fields:
    """Reads fields of one (sub-)dict of ``quantization_config``; errors name the path."""

    def __init__(self, raw: dict[str, Any], path: str, source: str) -> None:
        self.raw, self.path, self.source = raw, path, source

    def refuse(self, key: str, why: str) -> ValueError:
        value = self.raw.get(key)
        return ValueError(f"{self.source}: {self.path}.{key} = {value!r} is not served: {why}")

    def expect(self, key: str, allowed: tuple[Any, ...], why: str) -> Any:
        value = self.raw.get(key)
        if value not in allowed:
            raise self.refuse(key, why)
        return value

    def sub(self, key: str) -> _Fields | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.refuse(key, "expected an object")
        return _Fields(value, f"{self.path}.{key}", self.source)


def _kv_scheme(fields: _Fields) -> _Fields | None:
    """``kv_cache_scheme`` checked (FP8 e4m3, one static symmetric scale per layer for K and
    for V), or ``None`` when there is none."""
    scheme = fields.sub("kv_cache_scheme")
    if scheme is None:
        return None
    scheme.expect("type", ("float",), "an FP8 (e4m3) KV cache")
    scheme.expect("num_bits", (8,), "an FP8 (e4m3) KV cache")
    scheme.expect(
        "strategy", ("tensor",), "one K and one V scale per layer (not per head or channel)"
    )
    scheme.expect("dynamic", (None, False), "the KV scales are stored in the checkpoint")
    scheme.expect("symmetric", (None, True), "FP8 KV values are symmetric (no zero point)")
    return scheme


def parse_kv_cache_scheme(raw: dict[str, Any], source: str) -> bool:
    """Whether ``raw``'s ``quantization_config`` has a served ``kv_cache_scheme`` (its per-layer
    K/V scales are in the checkpoint); ``ValueError`` naming the field when it is not served."""
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("kv_cache_scheme") is None:
        return False
    fields = _Fields(qc, "quantization_config", source)
    if qc.get("quant_method") != "compressed-tensors":
        raise fields.refuse("kv_cache_scheme", "read from compressed-tensors checkpoints only")
    return _kv_scheme(fields) is not None


def parse_quantization_config(raw: dict[str, Any], source: str) -> CheckpointQuant | None:
    """``raw["quantization_config"]`` of ``config.json`` (at ``source``, for messages) read, or
    ``None`` when its weights are dense; ``ValueError`` naming the field when it is not served
    (a ``kv_cache_scheme`` is checked here too: :func:`parse_kv_cache_scheme` reads it)."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {qc!r}")
    fields = _Fields(qc, "quantization_config", source)
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(fields)
    if method == "gptq":
        return _gptq(fields)
    if method == "compressed-tensors":
        return _compressed_tensors(fields)
    if method == "fbgemm_fp8":
        ub = qc.get("activation_scale_ub")
        if ub is not None and (not isinstance(ub, int | float) or isinstance(ub, bool) or ub <= 0):
            raise fields.refuse("activation_scale_ub", "expected a positive number")
        return CheckpointQuant(
            "fp8", "fbgemm_fp8", input_scale_ub=None if ub is None else float(ub)
        )
    if qc.get("weight_block_size") is not None:
        raise fields.refuse("weight_block_size", "block-wise FP8 scales are not served")
    raise fields.refuse(
        "quant_method", "served: awq, gptq, compressed-tensors, fbgemm_fp8 (or a dense checkpoint)"
    )


def _group_size(fields: _Fields, key: str = "group_size") -> int:
    value = fields.raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
        raise fields.refuse(key, "expected a positive number of input columns, or -1")
    return value


def _awq(fields: _Fields) -> CheckpointQuant:
    fields.expect("bits", (4,), "only 4-bit weights")
    fields.expect("version", ("gemm", "GEMM"), "only AWQ's GEMM packing (not gemv/exllama/ipex)")
    fields.expect("zero_point", (True,), "AWQ GEMM checkpoints carry zero points")
    group = _group_size(fields)
    if group == -1:
        raise fields.refuse("group_size", "AWQ groups are a positive number of columns")
    return CheckpointQuant("awq", "awq", group, symmetric=False)


def _gptq(fields: _Fields) -> CheckpointQuant:
    fields.expect("bits", (4,), "only 4-bit weights")
    fmt = fields.expect(
        "checkpoint_format", (None, "gptq", "gptq_v2"), "served: gptq, gptq_v2 (not marlin)"
    )
    fields.expect("is_marlin_format", (None, False), "Marlin-packed GPTQ is not served")
    fields.expect("lm_head", (None, False), "a quantized LM head is not served")
    return CheckpointQuant(
        "gptq",
        "gptq",
        _group_size(fields),
        symmetric=bool(fields.raw.get("sym", True)),
        desc_act=bool(fields.raw.get("desc_act", False)),
        zeros_minus_one=fmt != "gptq_v2",
    )


def _compressed_tensors(fields: _Fields) -> CheckpointQuant | None:
    sparsity = fields.sub("sparsity_config")
    if sparsity is not None and sparsity.raw.get("format") not in (None, "dense"):
        raise sparsity.refuse("format", "sparse (e.g. 2:4) checkpoints are not served")
    if fields.raw.get("transform_config") is not None:
        raise fields.refuse(
            "transform_config", "rotated (Hadamard, SpinQuant) weights are not served"
        )
    kv_scheme = _kv_scheme(fields)
    groups = fields.sub("config_groups")
    if groups is None or not groups.raw:
        if kv_scheme is not None:
            return None  # only the KV cache is quantized: dense weights
        raise fields.refuse("config_groups", "expected at least one quantization scheme")
    schemes: set[CheckpointQuant] = set()
    for name in groups.raw:
        group = groups.sub(name)
        if group is None:
            raise groups.refuse(name, "expected a scheme")
        schemes.add(_ct_scheme(group, group if group.raw.get("format") else fields))
    if len(schemes) > 1:
        raise fields.refuse("config_groups", "one scheme for every quantized module")
    return schemes.pop()


def _ct_scheme(group: _Fields, owner: _Fields) -> CheckpointQuant:
    """One ``config_groups`` entry; ``owner``: where its ``format`` is (itself or the top)."""
    fmt = owner.raw.get("format")
    weights = group.sub("weights")
    if weights is None:
        raise group.refuse("weights", "expected a weight scheme")
    inputs = group.sub("input_activations")
    if group.raw.get("output_activations") is not None:
        raise group.refuse("output_activations", "output activations are not quantized")
    if fmt == "pack-quantized":
        weights.expect("type", ("int",), "pack-quantized weights are integers")
        weights.expect("num_bits", (4,), "only 4-bit weights")
        weights.expect("strategy", ("group",), "4-bit weights in groups along the input")
        weights.expect("actorder", (None,), "act-order (weight_g_idx) is not served")
        weights.expect("dynamic", (None, False), "weights have stored scales")
        if inputs is not None:
            raise group.refuse("input_activations", "4-bit weights serve 16-bit activations")
        group_size = _group_size(weights)
        symmetric = bool(weights.raw.get("symmetric", True))
        return CheckpointQuant("ct-int4", "compressed-tensors", group_size, symmetric)
    if fmt in ("float-quantized", "naive-quantized"):
        weights.expect("type", ("float",), "float-quantized weights are FP8")
        weights.expect("num_bits", (8,), "FP8 (e4m3) weights")
        weights.expect("strategy", ("channel", "tensor"), "served: channel, tensor (not block)")
        weights.expect("symmetric", (None, True), "FP8 weights are symmetric")
        weights.expect("dynamic", (None, False), "weights have stored scales")
        if inputs is None:
            raise group.refuse("input_activations", "FP8 weight-only (W8A16) is not served")
        inputs.expect("type", ("float",), "FP8 activations")
        inputs.expect("num_bits", (8,), "FP8 (e4m3) activations")
        inputs.expect("symmetric", (None, True), "FP8 activations without a zero point")
        dynamic = inputs.expect("dynamic", (True, False), "dynamic per token or static")
        inputs.expect(
            "strategy", (("token",) if dynamic else ("tensor",)), "dynamic per token or static"
        )
        return CheckpointQuant("fp8", "compressed-tensors", static_input=not dynamic)
    raise owner.refuse("format", "served: pack-quantized (int4), float-quantized (FP8)")


def check_quantization_flag(flag: str | None, quant: CheckpointQuant | None) -> None:
    """``--quantization`` against the checkpoint's own: one of them at most."""
    if flag is not None and quant is not None:
        raise ValueError(
            f"--quantization {flag}: the checkpoint is already quantized "
            f"({quant.method}, config.json quantization_config); drop the flag"
        )


def check_group_splits(quant: CheckpointQuant | None, tp: int, inputs: dict[str, int]) -> None:
    """``ValueError`` naming ``--tensor-parallel-size`` and ``quantization_config.group_size``
    when ``tp`` ranks would cut a 4-bit group of a row-parallel weight (``inputs``: what it is →
    its ``K`` inputs, split over the ranks), listing the sizes that do not. Act-order and one
    group per row split anywhere (every rank keeps the groups' scales)."""
    if quant is None or not quant.is_int4 or quant.desc_act or tp == 1:
        return
    g = quant.group_size
    for what, k in inputs.items():
        if g < 1 or g >= k or (k % tp == 0 and (k // tp) % g == 0):
            continue
        valid = [t for t in range(1, 65) if k % t == 0 and (k // t) % g == 0]
        raise ValueError(
            f"--tensor-parallel-size {tp}: {what} has {k} inputs in groups of {g} "
            f"(quantization_config.group_size), which {tp} ranks cannot split on group "
            f"boundaries; sizes that can: {valid}"
        )
