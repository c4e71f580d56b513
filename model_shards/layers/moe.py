"""Mixture-of-experts feed-forward: a router, a rank's experts stacked, an optional shared expert.

Shapes: ``T`` tokens, ``H`` hidden, ``E`` routed experts (``E_l`` on this rank), ``k`` per
token, ``I`` one expert's intermediate size (``I_l`` on this rank).

* Router (:func:`route`): ``logits = x W_g^T: [T, E]``, replicated, so every rank routes
  every token the same way; scores (softmax or sigmoid, float32); the top ``k`` ids
  ``[T, k]`` and their weights, divided by their sum where the config says so, times
  ``routed_scaling``.
* Experts (:class:`FusedExperts`), stacked so one backend call runs them all
  (:meth:`~model_shards.backends.base.Backend.fused_moe`), sharded one of two ways
  (:mod:`model_shards.config.moe`):

  - tensor parallel: every expert, sliced as a dense MLP is: ``w13 [E, 2 I/tp, H]`` (this
    rank's rows of gate, then of up), ``w2 [E, H, I/tp]`` (its columns of down);
  - expert parallel (``ShardContext.expert_parallel``): rank ``r``'s whole experts
    ``r E/tp .. (r+1) E/tp - 1``, ``w13 [E/tp, 2I, H]``, ``w2 [E/tp, H, I]``; a token's
    ids of other ranks' experts become ``-1`` here, and only this rank's experts are read
    from the checkpoint.

  A quantized checkpoint's experts load as stored, then become the backend's GGML blocks
  (``cpu``: 4-bit groups of 32 as Q4_0 / Q4_1, the stacked parameters emptied) or are
  dequantized into the stacked parameters (:mod:`.expert_quant`).

* Shared expert (Qwen2-MoE, DeepSeek): a dense SiLU MLP every token goes through
  (:class:`~model_shards.layers.mlp.GatedMLP`, its partial sum); Qwen2-MoE scales it per token by
  ``sigmoid(shared_expert_gate(x))``.
* Group-limited routing (DeepSeek-V2): the experts in ``num_groups`` equal groups; a token
  keeps the ``topk_groups`` groups of highest best score and picks its top ``k`` there.

Each rank's routed output and shared output are partial sums of ``[T, H]``; one
all-reduce adds them up (the all-reduce a dense MLP's down projection needs anyway).

Checkpoint tensors of a sparse layer's block: ``gate.weight [E, H]``,
``experts.{e}.{gate,up,down}.weight`` per expert (part names per family: Qwen's
``gate_proj/up_proj/down_proj``, Mixtral's ``w1/w3/w2``; :func:`expert_param_of` maps
them onto the stacked parameters), ``shared_expert.{gate,up,down}_proj.weight``
(DeepSeek: ``shared_experts``), ``shared_expert_gate.weight [1, H]``.

Every block counts the tokens routed to each expert (``expert_tokens [E]``, int64, on the
device; a CUDA graph's padding rows included) for ``/metrics``: :func:`expert_token_counts`,
sampled by rank 0 for its engine stats (:class:`ExpertTokenSampler`).
"""

from __future__ import annotations

import logging
import re
import time
from functools import cache

import torch
from torch import nn

from model_shards.backends.base import ExpertWeights
from model_shards.config.moe import MoEConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.expert_quant import ExpertHolders
from model_shards.layers.linear import (
    HasModules,
    ReplicatedLinear,
    check_dim,
    copy_checked,
    set_weight_loader,
)
from model_shards.layers.mlp import GatedMLP
from model_shards.parallel.comm import Comm, ep_all_to_all, tp_all_reduce
from model_shards.worker.checkpoint import CheckpointError, TensorSource

log = logging.getLogger(__name__)
ROLES = ("gate", "up", "down")
_EXPERT_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<part>[^.]+)\.weight$")


@cache
def _log_once(message: str) -> None:
    log.info(message)


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` → ``(weights [T, k] float32, ids [T, k] int64)``, the
    experts in descending score order (``torch.topk``'s, ties as it breaks them)."""
    scores = logits.float()
    scores = scores.softmax(dim=-1) if moe.scoring == "softmax" else scores.sigmoid()
    if moe.num_groups > 1:  # only the experts of the topk_groups best groups compete
        t, g = scores.shape[0], moe.num_groups
        best = scores.view(t, g, -1).max(dim=-1).values  # [T, G]
        keep = torch.zeros_like(best).scatter_(1, best.topk(moe.topk_groups, dim=-1)[1], 1.0)
        scores = scores.masked_fill(keep.repeat_interleave(scores.shape[1] // g, 1) == 0, 0.0)
    weights, ids = torch.topk(scores, moe.top_k, dim=-1)  # [T, k]
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.routed_scaling != 1.0:
        weights = weights * moe.routed_scaling
    return weights, ids


def expert_param_of(
    name: str, part_names: tuple[str, str, str]
) -> tuple[str, tuple[int, str]] | None:
    """A checkpoint expert tensor ``….experts.{e}.{part}.weight`` → the stacked parameter
    it fills (``….experts.w13_weight`` or ``w2_weight``) and its shard id ``(e, role)``,
    ``role`` one of :data:`ROLES` (``part_names``: the checkpoint's gate, up and down
    names); ``None`` for any other tensor."""
    match = _EXPERT_NAME.match(name)
    if match is None or match["part"] not in part_names:
        return None
    role = ROLES[part_names.index(match["part"])]
    stacked = "w2_weight" if role == "down" else "w13_weight"
    return f"{match['experts']}.{stacked}", (int(match["e"]), role)


class FusedExperts(nn.Module):
    """This rank's experts, stacked: ``w13_weight [E_l, 2 I_l, H]``, ``w2_weight [E_l, H, I_l]``
    (see the module docstring for the two shardings). ``forward`` returns this rank's
    partial sum; the caller all-reduces."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ctx: ShardContext) -> None:
        super().__init__()
        ps, self.ops = ctx.ps, ctx.ops
        if ctx.ep_comm is not None:  # data-parallel attention: whole experts over the EP group
            if ps.tp_size > 1:
                raise ValueError("data-parallel attention runs each replica at tp = 1")
            ps = ctx.ep_comm.ps
        expert_parallel = ctx.expert_parallel or ctx.ep_comm is not None
        problem = moe.layout_problem(ps.tp_size, expert_parallel)
        if problem:
            raise ValueError(f"experts cannot be split over {ps.tp_size} ranks: {problem}")
        if expert_parallel:  # whole experts, E / tp per rank
            self.num_local = moe.num_experts // ps.tp_size
            self.first_expert = ps.tp_rank * self.num_local
            self.slices, self.slice_rank = 1, 0
        else:  # every expert, a 1 / tp slice of each
            self.num_local, self.first_expert = moe.num_experts, 0
            self.slices, self.slice_rank = ps.tp_size, ps.tp_rank
        self.num_experts = moe.num_experts
        self.i_local = moe.expert_intermediate_size // self.slices
        shape13 = (self.num_local, 2 * self.i_local, hidden_size)
        shape2 = (self.num_local, hidden_size, self.i_local)
        self.w13_weight = nn.Parameter(torch.empty(shape13, dtype=ctx.dtype), False)
        self.w2_weight = nn.Parameter(torch.empty(shape2, dtype=ctx.dtype), False)
        set_weight_loader(self.w13_weight, self.weight_loader)
        set_weight_loader(self.w2_weight, self.weight_loader)
        self._weights: ExpertWeights | None = None  # with the backend's layouts, by prepare()
        self.dtype = ctx.dtype
        # a quantized checkpoint's experts as stored, until prepare() (layers/expert_quant.py)
        self._held: ExpertHolders | None = None
        self.quantized = False  # after prepare(): experts kept as the backend's GGML blocks

    def weight_loader(
        self, param: nn.Parameter, source: TensorSource, shard_id: tuple[int, str]
    ) -> None:
        """Fill local expert ``shard_id[0] - first_expert``'s gate, up or down
        (``shard_id[1]``) with this rank's slice; another rank's expert is not read."""
        expert, role = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return
        size, start = self.i_local, self.slice_rank * self.i_local
        dim = 1 if role == "down" else 0
        check_dim(source, dim, size * self.slices)
        if self._hold_quantized(source, dim, start, start + size, (local, role)):
            return
        if role == "down":
            copy_checked(param.data[local], source.read(1, start, start + size), source.name)
            return
        rows = param.data[local].narrow(0, 0 if role == "gate" else size, size)
        copy_checked(rows, source.read(0, start, start + size), source.name)

    def _hold_quantized(
        self, source: TensorSource, dim: int, start: int, end: int, where: tuple[int, str]
    ) -> bool:
        """A quantized checkpoint's slice held as stored (``worker/quant_sources.py``);
        ``False`` for a dense source or a slice off its group boundaries (read dense)."""
        read_quantized = getattr(source, "read_quantized", None)
        if read_quantized is None:
            return False
        try:
            part = read_quantized(dim, start, end)
        except CheckpointError:
            return False
        if self._held is None:
            self._held = ExpertHolders(self.num_local, self.i_local, self.w2_weight.shape[1])
        try:
            self._held.hold(where[1], where[0], part)
        except ValueError as exc:
            raise CheckpointError(f"tensor {source.name!r}: {exc}") from exc
        return True

    def prepare(self) -> bool:
        """After loading: each expert's matrices in the backend's GEMM layout (if it has one);
        a quantized checkpoint's experts as the backend's GGML blocks where every matrix has
        that form, else dequantized into the stacked parameters (:mod:`.expert_quant`)."""
        held, self._held = self._held, None
        if held is not None:
            forms = held.backend_forms(self.ops, self.dtype)
            if forms is not None:
                self.quantized = True
                panels = [self.ops.pack_quantized(w) for w in (*forms[0], *forms[1])]
                self.w13_weight.data = torch.empty(self.num_local, 0, 0, dtype=self.dtype)
                self.w2_weight.data = torch.empty(self.num_local, 0, 0, dtype=self.dtype)
                self._weights = ExpertWeights(self.w13_weight, self.w2_weight, *forms)
                return any(panels)
            _log_once(f"{self.ops.name} backend: quantized MoE experts dequantized at load")
            held.dequantize_into(self.w13_weight.data, self.w2_weight.data)
        packed13 = tuple(self.ops.pack_linear(w) for w in self.w13_weight)
        packed2 = tuple(self.ops.pack_linear(w) for w in self.w2_weight)
        packs = any(p is not None for p in packed13 + packed2)
        self._weights = ExpertWeights(
            self.w13_weight, self.w2_weight, *((packed13, packed2) if packs else ((), ()))
        )
        return packs

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids ``[T, k]`` → this rank's indices, ``-1`` for other ranks' experts."""
        if self.num_local == self.num_experts:
            return ids
        local = ids - self.first_expert
        return torch.where((local >= 0) & (local < self.num_local), local, -1)

    def held(self) -> ExpertWeights:
        """This rank's experts for the backend (with their packed layouts once prepared)."""
        return self._weights or ExpertWeights(self.w13_weight, self.w2_weight)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, router ``weights``/``ids [T, k]`` → this rank's partial ``[T, H]``."""
        return self.ops.fused_moe(x, self.held(), weights, self.local_ids(ids))


def dispatch_to_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: FusedExperts, comm: Comm
) -> torch.Tensor:
    """Data-parallel attention with expert-parallel MoE: this rank's *own* tokens
    ``x [T, H]`` (``T`` may be 0: an idle rank still takes part), routed to global experts
    ``ids`` with ``weights [T, k]``, through the experts of every rank of the EP group
    (``comm``'s TP group; rank ``r`` holds ``experts`` ``r E_l .. (r + 1) E_l - 1``).

    Each (token, expert) pair goes to the rank holding its expert (all-to-all of the rows,
    then of ``[local id, weight]``), is computed there (``fused_moe``, one pair per row) and
    comes back the same way; the pairs' outputs are summed per token in float32. Returns
    the routed output ``[T, H]`` of this rank's tokens, complete (no all-reduce after)."""
    k, per_rank = ids.shape[1], experts.num_local
    flat = ids.reshape(-1)  # [T k]
    dest = torch.div(flat, per_rank, rounding_mode="floor")  # [T k] the rank holding each
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=experts.num_experts // per_rank).tolist()
    tokens = order // k  # [T k] each sent pair's token
    rows, recv = ep_all_to_all(x.index_select(0, tokens), send, comm)  # [N, H]
    meta = torch.stack(((flat - dest * per_rank).float(), weights.reshape(-1)), dim=1)[order]
    meta, _ = ep_all_to_all(meta, send, comm, recv)  # [N, 2]: local id, weight
    y = experts.ops.fused_moe(rows, experts.held(), meta[:, 1:], meta[:, :1].long())  # [N, H]
    back, _ = ep_all_to_all(y, recv, comm, send)  # [T k, H], in ``order``
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, back.float())
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router → experts (+ shared expert) → one all-reduce: ``[T, H]`` → ``[T, H]``.
    ``part_names``: the checkpoint's names of an expert's gate, up and down matrices."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        layer_idx: int,
        ctx: ShardContext,
        part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        self.moe, self.layer_idx, self.comm = moe, layer_idx, ctx.comm
        self.part_names = part_names
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts, bias=False, ctx=ctx)
        self.experts = FusedExperts(hidden_size, moe, ctx)
        self.shared_expert_gate: ReplicatedLinear | None = None
        if moe.shared_intermediate_size:  # under its checkpoint name: shared_expert(s)
            shared = GatedMLP(hidden_size, moe.shared_intermediate_size, ctx)
            self.add_module(moe.shared_name, shared)
            if moe.shared_gate:
                self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, ctx=ctx)
        self.expert_tokens = torch.zeros(moe.num_experts, dtype=torch.int64)  # [E], not a weight
        self.ep_comm = ctx.ep_comm
        self.dispatches = 0  # all-to-all exchanges joined (data-parallel attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe)  # [T, k] each
        flat = ids.reshape(-1)
        self.expert_tokens.index_add_(0, flat, torch.ones_like(flat))
        if self.ep_comm is not None:  # every rank's experts, this rank's tokens: complete
            self.dispatches += 1
            out = dispatch_to_experts(x, weights, ids, self.experts, self.ep_comm)
        else:
            out = self.experts(x, weights, ids)  # [T, H], this rank's experts
        if self.moe.shared_intermediate_size:
            shared_expert = self.get_submodule(self.moe.shared_name)
            assert isinstance(shared_expert, GatedMLP)
            shared = shared_expert.partial(x)  # [T, H], this rank's slice
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))  # [T, 1] per token
            out = out + shared
        return tp_all_reduce(out, self.comm)  # [T, H]

    def idle(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Data-parallel attention, a step without tokens here: join the exchange anyway
        (sending none, computing what the others send to this rank's experts)."""
        assert self.ep_comm is not None
        self.dispatches += 1
        empty = torch.empty(0, hidden_size, dtype=dtype, device=device)
        ids = torch.empty(0, self.moe.top_k, dtype=torch.int64, device=device)
        weights = torch.empty(0, self.moe.top_k, dtype=torch.float32, device=device)
        dispatch_to_experts(empty, weights, ids, self.experts, self.ep_comm)

    @staticmethod
    def checkpoint_suffixes(moe: MoEConfig, part_names: tuple[str, str, str]) -> list[str]:
        """The checkpoint names of one sparse block's tensors, relative to the block."""
        names = ["gate.weight"]
        names += [f"experts.{e}.{p}.weight" for e in range(moe.num_experts) for p in part_names]
        if moe.shared_intermediate_size:
            names += [f"{moe.shared_name}.{p}_proj.weight" for p in ROLES]
            if moe.shared_gate:
                names.append("shared_expert_gate.weight")
        return names


class ExpertTokenSampler:
    """Rank 0: :func:`expert_token_counts` of its model at most once per ``interval_s``
    (``None`` in between, and always for a model without experts), for the engine stats."""

    def __init__(self, model: HasModules, interval_s: float = 1.0) -> None:
        self.model = model
        self.has_experts = any(isinstance(m, SparseMoeBlock) for m in model.modules())
        self.interval_s = interval_s
        self._next = 0.0

    def sample(self) -> dict[int, list[int]] | None:
        now = time.monotonic()
        if not self.has_experts or now < self._next:
            return None
        self._next = now + self.interval_s
        return expert_token_counts(self.model)


def expert_token_counts(model: HasModules) -> dict[int, list[int]]:
    """Tokens routed to each expert since start-up, by decoder layer, for the sparse layers
    of ``model`` this stage holds (empty for a dense model)."""
    return {
        m.layer_idx: m.expert_tokens.tolist()
        for m in model.modules()
        if isinstance(m, SparseMoeBlock)
    }
