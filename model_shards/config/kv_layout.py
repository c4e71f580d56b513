"""KV cache groups: which layers share a block table, and which memory they share.

Whole-context layers alone (Llama) make one group. Interleaved sliding-window and global
layers (Gemma 2 and 3) need more: a block that left a sliding layer's window is dead for it
but alive for the global ones. So layers split into *groups* of equal size, each of one
attention type (a window, or ``None``) with its own block table per sequence. A block id
belongs to one group of one sequence at a time, and groups *share memory*: the ``j``-th layer
of every group writes into buffer ``j`` (its *slot*), so a block costs ``group size`` layers.

Group size is the smallest type's layer count (Gemma 3, five sliding to one global: ``L / 6``);
a type it does not divide gets a smaller last group. Group 0 is whole-context when the model
has one (its block keys are the plain prefix hashes; other groups' are group-tagged).

The scheduler releases a sliding group's blocks outside every later query's window (entry
``-1`` on rank 0), so a sequence holds at most ``ceil((window - 1 + chunk) / bs) + 1`` of them.
Torch-free: rank 0's scheduler and every rank read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model_shards.config.model import ModelConfig

# families whose layers alternate sliding-window and global attention, with the
# transformers default pattern when ``layer_types`` is absent: every n-th layer is global
_SLIDING_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
# families whose ``sliding_window`` applies to every layer (as transformers' models do)
_EVERY_LAYER = ("MistralForCausalLM", "Phi3ForCausalLM")
# families with ``use_sliding_window``: then the layers from ``max_window_layers`` on
_FROM_LAYER = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
WINDOWED_ARCHITECTURES = (*_SLIDING_PATTERN, *_EVERY_LAYER, *_FROM_LAYER)
"""The architectures whose sliding windows are served (other families refuse a window
that would change their output, before spawning)."""


def layer_windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Each decoder layer's window (``None``: whole context), as transformers reads the config:
    Gemma 2 / 3 from ``layer_types`` or their default pattern; Mistral and Phi-3 on every layer;
    Qwen2 / Qwen3 with ``use_sliding_window``, from ``layer_types`` or ``max_window_layers`` on.
    A window ``>= max_position_embeddings`` never matters: ``None``."""
    n, raw, arch = cfg.num_layers, cfg.extra, cfg.architecture
    window = raw.get("sliding_window")
    if window is None or arch not in WINDOWED_ARCHITECTURES:
        return (None,) * n
    if arch in _FROM_LAYER and not raw.get("use_sliding_window"):
        return (None,) * n
    if arch not in _SLIDING_PATTERN and int(window) >= cfg.max_position_embeddings:
        return (None,) * n
    types = raw.get("layer_types") or _default_types(arch, n, raw)
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _default_types(arch: str, n: int, raw: Mapping[str, Any]) -> list[str]:
    """transformers' ``layer_types`` when the config does not list them."""
    if arch in _SLIDING_PATTERN:
        every = int(raw.get("sliding_window_pattern", _SLIDING_PATTERN[arch]))
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    first = int(raw.get("max_window_layers", 0)) if arch in _FROM_LAYER else 0
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


@dataclass(frozen=True)
class KVGroup:
    """Layers (global indices) sharing one block table; the ``j``-th writes into slot ``j``."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    """The model's KV groups (group 0 first); see the module docstring."""

    groups: tuple[KVGroup, ...]

    @staticmethod
    def of(windows: Sequence[int | None]) -> KVLayout:
        """Groups for per-layer ``windows``: whole-context first, then windows by first use."""
        types: dict[int | None, list[int]] = {}
        if None in windows:
            types[None] = []
        for i, w in enumerate(windows):
            types.setdefault(w, []).append(i)
        size = min(len(layers) for layers in types.values())
        groups = [
            KVGroup(window, tuple(layers[s : s + size]))
            for window, layers in types.items()
            for s in range(0, len(layers), size)
        ]
        return KVLayout(tuple(groups))

    @staticmethod
    def for_model(cfg: ModelConfig) -> KVLayout:
        return KVLayout.of(layer_windows(cfg))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window, group 0 first (what rank 0's scheduler needs)."""
        return tuple(g.window for g in self.groups)

    def group_of(self, layer: int) -> int:
        return next(g for g, group in enumerate(self.groups) if layer in group.layers)

    def slot_of(self, layer: int) -> int:
        """The memory slot (buffer) ``layer`` writes into."""
        return self.groups[self.group_of(layer)].layers.index(layer)

    def slots_on(self, layers: range) -> int:
        """Buffers a stage holding ``layers`` allocates: its layers' distinct slots."""
        return len({self.slot_of(i) for i in layers})


def peak_blocks(windows: Sequence[int | None], tokens: int, block_size: int, max_chunk: int) -> int:
    """Most block ids a sequence of ``tokens`` positions holds over KV groups ``windows``, in
    chunks of at most ``max_chunk``: a windowed group keeps ``window - 1 + max_chunk`` positions
    (a chunk plus its first query's window), which may straddle one more block."""
    full = -(-tokens // block_size)
    live = [
        full if w is None else min(full, -(-(w - 1 + max_chunk) // block_size) + 1) for w in windows
    ]
    return sum(live)


def window_start(window: int | None, first_query: int) -> int:
    """First position any query at ``first_query`` or later may attend to (``kv > q - window``)."""
    return 0 if window is None else max(0, first_query - window + 1)
