"""A vision-language model's images on the first pipeline stage: each sequence's images
(from its ``NewSequence``), an encoder-output cache by content hash, and the step's input
embeddings with every image's rows scattered into its placeholder positions.

Every TP rank of the first stage sees the same plans in the same order, so their caches
make the same decisions and they run the (TP-sharded) vision tower together. A prefill
chunk may hold any slice of an image's placeholder run: the whole image's embeddings
stay cached and the chunk takes its rows; an evicted entry is recomputed from the
sequence's pixels, which stay here until the sequence is freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from model_shards.messages import MediaInput, SeqChunk, StepPlan
from model_shards.models import DecoderModel
from model_shards.parallel.state import ParallelState

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CACHE_ENTRIES = 64


class VisionLanguageModel(Protocol):
    """What a vision-language family gives the first stage (``models/llava.py``)."""

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` → ``[T, H]``."""
        ...

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, C, S, S]`` → ``[N, tokens_per_image, H]``. A model that defines
        ``encode_media`` (:class:`MediaEncoder`) is called through that instead."""
        ...


class MediaEncoder(Protocol):
    """Optional, for items of different shapes (dynamic resolution, video:
    ``models/qwen2_5_vl.py``): all of a step's missing items in one call."""

    def encode_media(
        self, items: Sequence[MediaInput], pixels: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``pixels[i]``: ``items[i]``'s array (:func:`pixels_of`) → its embeddings
        ``[items[i].length, H]``, one per placeholder."""
        ...


@dataclass
class EncoderCacheStats:
    """Images encoded (``misses``) and served from the cache (``hits``), per image per
    step that needed its rows."""

    hits: int = 0
    misses: int = 0


def pixels_of(item: MediaInput, device: torch.device) -> torch.Tensor:
    """The item's pixel array ``shape`` from its raw bytes (``ValueError`` on a mismatch)."""
    dtype = _DTYPES.get(item.dtype)
    if dtype is None:
        raise ValueError(f"media dtype {item.dtype!r} is not one of {', '.join(_DTYPES)}")
    count = 1
    for d in item.shape:
        count *= d
    if count * dtype.itemsize != len(item.pixels):
        raise ValueError(f"media of shape {item.shape} needs {count * dtype.itemsize} bytes")
    flat = torch.frombuffer(bytearray(item.pixels), dtype=dtype)
    return flat.view(item.shape).to(device)


class MediaInputs:
    """The first stage's images and encoder cache (see the module docstring)."""

    def __init__(
        self,
        model: VisionLanguageModel,
        device: torch.device,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        self.model = model
        self.device = device
        self.cache_entries = cache_entries
        self.by_seq: dict[int, list[MediaInput]] = {}
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # hash → [P, H]
        self.stats = EncoderCacheStats()

    def observe(self, plan: StepPlan) -> None:
        """Forget freed sequences, then take the images of the plan's new ones."""
        for seq_id in plan.freed_seq_ids:
            self.by_seq.pop(seq_id, None)
        for new in plan.new_sequences:
            if new.media:
                self.by_seq[new.seq_id] = list(new.media)

    def touches(self, chunks: Sequence[SeqChunk]) -> bool:
        """Whether any chunk holds an image placeholder position."""
        return any(_overlaps(c, self.by_seq.get(c.seq_id, ())) for c in chunks)

    def embed(self, ids: torch.Tensor, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """``ids [T]`` (the chunks' tokens, concatenated) → input embeddings ``[T, H]``."""
        x = self.model.embed_input_ids(ids)
        features = self._features(chunks)
        row = 0
        for chunk in chunks:
            lo, hi = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
            for item in self.by_seq.get(chunk.seq_id, ()):
                a, b = max(lo, item.offset), min(hi, item.offset + item.length)
                if a < b:
                    rows = features[item.content_hash][a - item.offset : b - item.offset]
                    x[row + a - lo : row + b - lo] = rows.to(x.dtype)
            row += hi - lo
        return x

    def _features(self, chunks: Sequence[SeqChunk]) -> dict[bytes, torch.Tensor]:
        """Each image the step needs → its embeddings ``[P, H]``; the missing ones encoded
        in one batch (images of one shape), then cached (least recently used evicted)."""
        needed: dict[bytes, MediaInput] = {}
        for chunk in chunks:
            for item in _overlapping(chunk, self.by_seq.get(chunk.seq_id, ())):
                needed.setdefault(item.content_hash, item)
        out: dict[bytes, torch.Tensor] = {}
        missing: list[MediaInput] = []
        for key, item in needed.items():
            if key in self.cache:
                self.cache.move_to_end(key)
                out[key] = self.cache[key]
                self.stats.hits += 1
            else:
                missing.append(item)
        for items, encoded in self._encode(missing):
            for item, rows in zip(items, encoded, strict=True):
                if rows.shape[0] != item.length:
                    raise ValueError(
                        f"an image encodes to {rows.shape[0]} embeddings, its placeholder run "
                        f"has {item.length}"
                    )
                out[item.content_hash] = self.cache[item.content_hash] = rows
                self.stats.misses += 1
        while len(self.cache) > self.cache_entries:
            self.cache.popitem(last=False)
        return out

    def _encode(
        self, missing: list[MediaInput]
    ) -> list[tuple[list[MediaInput], Sequence[torch.Tensor]]]:
        """The missing items' embeddings, in batches (:func:`encode_batches`)."""
        if not missing:
            return []
        return encode_batches(self.model, missing, [pixels_of(i, self.device) for i in missing])


def encode_batches(
    model: object, items: Sequence[MediaInput], pixels: Sequence[torch.Tensor]
) -> list[tuple[list[MediaInput], Sequence[torch.Tensor]]]:
    """``items`` (``pixels[i]``: item ``i``'s array) through the model's tower: one
    :meth:`MediaEncoder.encode_media` call where the model has it, else one
    ``encode_images`` per pixel shape; each batch's items with their embeddings
    ``[length, H]``."""
    encoder = getattr(model, "encode_media", None)
    if encoder is not None:
        return [(list(items), encoder(items, pixels))]
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, item in enumerate(items):
        by_shape.setdefault(tuple(item.shape), []).append(i)
    out: list[tuple[list[MediaInput], Sequence[torch.Tensor]]] = []
    for group in by_shape.values():
        stacked = torch.stack([pixels[i] for i in group])  # [N, C, S, S]
        encoded = model.encode_images(stacked)  # type: ignore[attr-defined]  # [N, P, H]
        out.append(([items[i] for i in group], list(encoded)))
    return out


def _overlapping(chunk: SeqChunk, items: Sequence[MediaInput]) -> list[MediaInput]:
    lo, hi = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
    return [i for i in items if i.offset < hi and i.offset + i.length > lo]


def _overlaps(chunk: SeqChunk, items: Sequence[MediaInput]) -> bool:
    return bool(_overlapping(chunk, items))


def takes_images(model: DecoderModel, ps: ParallelState) -> bool:
    """Whether this rank runs a vision tower: a vision-language model's first stage."""
    return ps.is_first_stage and (hasattr(model, "encode_images") or hasattr(model, "encode_media"))
