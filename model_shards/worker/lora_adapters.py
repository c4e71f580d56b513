"""Every rank's LoRA adapters (``--enable-lora``): slots on the device, adapters in host memory.

Rank 0 decides which adapter sits in which of the ``--max-loras`` slots (the scheduler's
:mod:`~model_shards.engine.scheduler.lora_slots`); a plan's ``lora_loads`` tell every rank to
fill a slot, each with its own shares (:mod:`model_shards.layers.lora`) of the layers of its
pipeline stage. Adapters read from disk stay in a host LRU of ``--max-cpu-loras``, so a slot
swapped back in is not read again. Before each forward :meth:`LoraAdapters.set_batch` maps the
step's rows to their slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from model_shards.backends.base import LoraBatch
from model_shards.config.lora import WEIGHTS_FILE, LoraOptions, module_shape, read_adapter
from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from model_shards.layers.lora import LoraState, LoraWeights
from model_shards.messages import LoraLoad, LoraRef, SeqChunk

log = logging.getLogger(__name__)

# an adapter's module → (our layer, its checkpoint part, its part index in the layer)
_PARTS: dict[str, tuple[str, int | str | None, int]] = {
    "q_proj": ("qkv_proj", "q", 0),
    "k_proj": ("qkv_proj", "k", 1),
    "v_proj": ("qkv_proj", "v", 2),
    "o_proj": ("o_proj", None, 0),
    "gate_proj": ("gate_up_proj", 0, 0),
    "up_proj": ("gate_up_proj", 1, 1),
    "down_proj": ("down_proj", None, 0),
}
# our layer → (an adapter module it holds, how many parts it fuses)
_LAYERS = {
    "qkv_proj": ("q_proj", 3),
    "o_proj": ("o_proj", 1),
    "gate_up_proj": ("gate_proj", 2),
    "down_proj": ("down_proj", 1),
}
_PREFIX = "base_model.model."


class HostAdapter:
    """An adapter in host memory: its scale and tensors by our module name (``model.layers.
    {i}.{self_attn|mlp}.{q_proj…}.lora_{A|B}.weight``, the PEFT prefix dropped)."""

    def __init__(self, ref: LoraRef, cfg: ModelConfig, max_rank: int) -> None:
        info = read_adapter(ref.name, ref.path, cfg, max_rank, flag="LoRA adapter")
        self.scale = info.scale
        raw = load_file(str(Path(ref.path) / WEIGHTS_FILE))
        self.tensors = {k.removeprefix(_PREFIX): v.float() for k, v in raw.items()}


class LoraAdapters:
    """This rank's adapter slots over every LoRA-capable linear of its stage."""

    def __init__(self, stack: object, cfg: ModelConfig, ctx: ShardContext, opts: LoraOptions):
        """``stack``: the model's decoder layer stack (``model.model``, this stage's layers)."""
        self.cfg, self.opts, self.ps = cfg, opts, ctx.ps
        self.state = LoraState()
        self.layers: dict[str, LinearBase] = {}
        for name, module in _lora_layers(stack):
            first, parts = _LAYERS[name.rpartition(".")[2]]
            n_in, n_out = module_shape(cfg, first)
            if isinstance(module, ColumnParallelLinear):
                shape = (n_in, module.out_local)
            else:
                assert isinstance(module, RowParallelLinear)
                shape = (module.in_local, n_out)
            slots, rank = opts.max_loras, opts.max_lora_rank
            module.lora = LoraWeights(
                slots, parts, rank, shape, self.state, ctx.ops, ctx.dtype, ctx.ps.device
            )
            self.layers[name] = module
        self._host: OrderedDict[LoraRef, HostAdapter] = OrderedDict()  # read adapters, LRU
        self._checked: OrderedDict[LoraRef, None] = OrderedDict()  # rank 0: adapters found good
        self._static = torch.empty(0, dtype=torch.int64)  # decode graphs' row slots

    def problem(self, ref: LoraRef) -> str | None:
        """Rank 0: why this replica cannot serve ``ref`` (files, rank, targets, shapes), or
        ``None``; an adapter found good is remembered (the last 1024)."""
        if ref not in self._checked:
            try:
                read_adapter(ref.name, ref.path, self.cfg, self.opts.max_lora_rank, "LoRA adapter")
            except ValueError as exc:
                return str(exc)
            self._checked[ref] = None
            if len(self._checked) > 1024:
                self._checked.popitem(last=False)
        return None

    def load(self, loads: list[LoraLoad]) -> None:
        """Fill each slot of ``loads`` with its adapter (from the host LRU, or read)."""
        for load in loads:
            adapter = self._host_adapter(load.lora)
            for layer in self.layers.values():
                assert layer.lora is not None
                layer.lora.clear(load.slot)
            for key, a in adapter.tensors.items():
                if key.endswith(".lora_A.weight"):
                    module = key.removesuffix(".lora_A.weight")
                    b = adapter.tensors[f"{module}.lora_B.weight"]
                    self._fill(load.slot, module, a, b, adapter.scale)
            log.info("LoRA adapter %s in slot %d", load.lora.name, load.slot)

    def _host_adapter(self, ref: LoraRef) -> HostAdapter:
        adapter = self._host.pop(ref, None) or HostAdapter(ref, self.cfg, self.opts.max_lora_rank)
        self._host[ref] = adapter  # most recently used last
        while len(self._host) > self.opts.max_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def _fill(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """One module's ``a [r, in]``, ``b [out, r]``: this rank's shares into its layer."""
        base, _, leaf = module.rpartition(".")
        fused, shard_id, part = _PARTS[leaf]
        layer = self.layers.get(f"{base}.{fused}")
        if layer is None:  # another pipeline stage's layer
            return
        assert layer.lora is not None
        if isinstance(layer, ColumnParallelLinear):  # b: the rows of this rank's outputs
            offset, _total, start, size = layer.out_rows(shard_id)
            b, rows = b[start : start + size], slice(offset, offset + size)
        else:  # row parallel: a's columns of this rank's inputs
            assert isinstance(layer, RowParallelLinear)
            lo = self.ps.tp_rank * layer.in_local
            a, rows = a[:, lo : lo + layer.in_local], slice(None)
        layer.lora.fill(slot, part, a, b, rows, scale)

    def graph_slots(self, max_rows: int) -> None:
        """Before decode graphs are captured: every forward reads the slots of its rows from
        one static tensor (``-1`` until a graphed step fills it)."""
        self._static = torch.full((max_rows,), -1, dtype=torch.int64, device=self.ps.device)
        self.state.batch = LoraBatch(None, self._static)

    def set_batch(self, chunks: list[SeqChunk], graphed: bool = False) -> None:
        """Map the step's rows (its chunks' tokens, in order) to their chunks' slots; a
        ``graphed`` decode step writes them into the graphs' static slots instead."""
        if graphed:
            slots = [c.lora_slot for c in chunks]
            slots += [-1] * (self._static.shape[0] - len(slots))  # padding rows: none
            self._static.copy_(torch.tensor(slots), non_blocking=True)
            self.state.batch = LoraBatch(None, self._static)
            return
        if all(c.lora_slot < 0 for c in chunks):
            self.state.batch = None
            return
        ends = list(accumulate(len(c.token_ids) for c in chunks))
        spans: dict[int, list[tuple[int, int]]] = {}
        for chunk, end in zip(chunks, ends, strict=True):
            if chunk.lora_slot >= 0:
                spans.setdefault(chunk.lora_slot, []).append((end - len(chunk.token_ids), end))
        device = self.ps.device
        groups: list[tuple[int, slice | torch.Tensor]] = []
        row_slots = torch.full((ends[-1],), -1, dtype=torch.int64)
        for slot, runs in spans.items():
            for lo, hi in runs:
                row_slots[lo:hi] = slot
            if all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1)):
                groups.append((slot, slice(runs[0][0], runs[-1][1])))
            else:
                rows = torch.cat([torch.arange(lo, hi) for lo, hi in runs])
                groups.append((slot, rows.to(device)))
        self.state.batch = LoraBatch(groups, row_slots.to(device))


def _lora_layers(stack: object) -> Iterator[tuple[str, LinearBase]]:
    """The decoder layers' linears an adapter may target, by module name (``model.layers.{i}.
    self_attn.qkv_proj``, as the adapter's tensors are named)."""
    if not isinstance(stack, nn.Module):
        raise TypeError(f"LoRA: {type(stack).__name__} is not a module stack")
    for name, module in stack.named_modules(prefix="model"):
        linear = isinstance(module, ColumnParallelLinear | RowParallelLinear)
        if linear and ".layers." in name and name.rpartition(".")[2] in _LAYERS:
            yield name, module
