"""The mixture-of-experts fields of a ``config.json``, and the layouts that can shard them.

No torch import: :meth:`ReplicaConfig.validate <model_shards.config.replica.ReplicaConfig.validate>`
calls :func:`check_expert_layout` in the parent, before any rank is spawned.

Two ways to shard experts over a TP group of ``tp`` ranks:

* tensor parallel (the default): every expert on every rank, each sliced like a dense MLP
  (gate/up rows, down columns): the expert size must divide by ``tp``;
* expert parallel (``--enable-expert-parallel``): rank ``r`` holds whole experts
  ``r * E / tp .. (r + 1) * E / tp - 1``: the expert count ``E`` must divide by ``tp``.

Either way each rank's partial output is summed by the all-reduce the layer needs anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from model_shards.config.model import ModelConfig

Scoring = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class MoEConfig:
    """One model's experts: the same in every sparse layer."""

    num_experts: int  # E, routed experts per sparse layer
    top_k: int  # experts each token is routed to
    expert_intermediate_size: int  # I of one expert's gate/up/down
    scoring: Scoring  # router scores: softmax (Mixtral, Qwen) or sigmoid over the logits
    renormalize: bool  # top-k weights divided by their sum
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(gate(x)) (Qwen2-MoE)
    routed_scaling: float = 1.0  # every routed weight multiplied by this (DeepSeek)
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP instead of experts
    # group-limited routing (DeepSeek-V2): the experts in num_groups equal groups, a token's
    # top-k taken within the topk_groups groups of highest best score; 1, 1: plain top-k
    num_groups: int = 1
    topk_groups: int = 1
    shared_name: str = "shared_expert"  # the shared expert's module in the checkpoint

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has experts (else Llama's dense MLP)."""
        return layer not in self.dense_layers

    def check(self) -> None:
        """``ValueError`` naming the ``config.json`` field that cannot be served."""
        if self.num_experts < 1:
            raise ValueError(f"config.json: {self.num_experts} experts; need at least 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok {self.top_k} must be in 1..{self.num_experts}"
            )
        if self.expert_intermediate_size < 1:
            raise ValueError("config.json: the experts' intermediate size must be positive")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"config.json: n_group {self.num_groups} must divide the {self.num_experts} experts"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"config.json: topk_group {self.topk_groups} must be in 1..{self.num_groups}"
            )

    def layout_problem(self, tp: int, expert_parallel: bool) -> str | None:
        """Why ``tp`` ranks cannot hold the experts this way, or ``None``."""
        if expert_parallel and self.num_experts % tp:
            return f"its {self.num_experts} experts are not divisible by {tp}"
        if not expert_parallel and self.expert_intermediate_size % tp:
            return (
                f"the expert intermediate size {self.expert_intermediate_size} is not "
                f"divisible by {tp}"
            )
        if self.shared_intermediate_size % tp:
            return (
                f"the shared expert's intermediate size {self.shared_intermediate_size} is not "
                f"divisible by {tp}"
            )
        return None


def _qwen_moe(raw: Mapping[str, Any], num_layers: int) -> MoEConfig:
    """Qwen2-MoE / Qwen3-MoE: softmax routing, renormalised when ``norm_topk_prob``; a layer
    is dense when listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    only_mlp = {int(i) for i in raw.get("mlp_only_layers") or ()}
    dense = frozenset(
        i for i in range(num_layers) if i in only_mlp or experts == 0 or (i + 1) % step
    )
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(
        num_experts=experts,
        top_k=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        scoring="softmax",
        renormalize=bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_gate=shared > 0,
        dense_layers=dense,
    )


def _deepseek_v2(raw: Mapping[str, Any], num_layers: int) -> MoEConfig:
    """DeepSeek-V2: softmax scores, top-k (``greedy``) or group-limited
    (``group_limited_greedy``), never renormalised, times ``routed_scaling_factor``;
    ``n_shared_experts`` shared experts as one MLP (``shared_experts``, no gate); the first
    ``first_k_dense_replace`` layers dense."""
    method = str(raw.get("topk_method") or "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"config.json: topk_method {method!r} not supported (greedy, group_limited_greedy)"
        )
    grouped = method == "group_limited_greedy"
    first_moe = int(raw.get("first_k_dense_replace") or 0)
    return MoEConfig(
        num_experts=int(raw["n_routed_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        scoring="softmax",
        renormalize=False,
        shared_intermediate_size=int(raw["moe_intermediate_size"])
        * int(raw.get("n_shared_experts") or 0),
        routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
        dense_layers=frozenset(range(min(first_moe, num_layers))),
        num_groups=int(raw["n_group"]) if grouped else 1,
        topk_groups=int(raw["topk_group"]) if grouped else 1,
        shared_name="shared_experts",
    )


def moe_config(cfg: ModelConfig) -> MoEConfig | None:
    """The experts of ``cfg``'s architecture, or ``None`` for a dense model.
    ``ValueError`` naming the ``config.json`` field when one is missing or malformed."""
    raw = cfg.extra
    try:
        if cfg.architecture == "MixtralForCausalLM":
            return MoEConfig(
                num_experts=int(raw["num_local_experts"]),
                top_k=int(raw["num_experts_per_tok"]),
                expert_intermediate_size=cfg.intermediate_size,
                scoring="softmax",
                renormalize=True,
            )
        if cfg.architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            return _qwen_moe(raw, cfg.num_layers)
        if cfg.architecture == "DeepseekV2ForCausalLM":
            return _deepseek_v2(raw, cfg.num_layers)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json: malformed or missing expert field ({exc!r})") from exc
    return None


def check_expert_layout(cfg: ModelConfig, tp: int, expert_parallel: bool) -> None:
    """``ValueError`` naming the flag when ``tp`` ranks cannot hold ``cfg``'s experts (see
    the module docstring), listing the sizes that can; ``--enable-expert-parallel`` on a
    model without experts is refused too."""
    moe = moe_config(cfg)
    if moe is None:
        if expert_parallel:
            raise ValueError(
                f"--enable-expert-parallel: {cfg.architecture} has no experts (it is not a "
                f"mixture-of-experts model); drop the flag"
            )
        return
    moe.check()
    problem = moe.layout_problem(tp, expert_parallel)
    if problem is None:
        return
    valid = [t for t in cfg.valid_tp_sizes() if moe.layout_problem(t, expert_parallel) is None]
    if expert_parallel:
        raise ValueError(
            f"--enable-expert-parallel with --tensor-parallel-size {tp}: {problem}; "
            f"valid sizes with expert parallelism: {valid}"
        )
    raise ValueError(
        f"--tensor-parallel-size {tp} does not fit this model's experts: {problem}; valid "
        f"sizes: {valid} (or shard whole experts with --enable-expert-parallel)"
    )
