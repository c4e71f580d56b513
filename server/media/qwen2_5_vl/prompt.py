"""Qwen2.5-VL prompts in the frontend: the checkpoint's vision tokens and preprocessing,
and each ``<|image_pad|>`` / ``<|video_pad|>`` of the rendered prompt expanded to its
item's placeholder run.

Qwen2-VL's chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for an
image part and the same with ``<|video_pad|>`` for a video part; a template that joins
content to strings leaves :mod:`server.media.parts`' markers instead, and they become
the same three tokens here. Each pad then stands for ``t * h * w // merge**2`` tokens
(transformers' ``Qwen2_5_VLProcessor`` replaces the i-th image pad with the i-th image's
run, the j-th video pad with the j-th video's; the pads are special tokens, so expanding
ids after tokenizing gives the ids transformers gets by tokenizing the expanded text).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model_shards.config.qwen2_5_vl import qwen_vl_config
from model_shards.messages import MediaInput
from server.http.errors import APIError
from server.media.parts import MEDIA_MARKER, VIDEO_MARKER
from server.media.qwen2_5_vl.image import QwenVLPreprocessor
from server.media.qwen2_5_vl.video import QwenVLVideoPreprocessor
from server.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class PreparedImage:
    """One image or video of a request, preprocessed. ``pixels``: ``[3, H, W]`` for a
    fixed-size tower (LLaVA); the flattened patches ``[t * h * w, C * T * P * P]`` of
    ``grid_thw`` for Qwen2.5-VL, whose ``num_tokens`` placeholders it takes."""

    pixels: np.ndarray
    kind: str = "image"  # "image" or "video"
    grid_thw: tuple[int, ...] = ()
    second_per_grid: float = 0.0
    num_tokens: int = 0

    @property
    def content_hash(self) -> bytes:
        """SHA-256 over the pixels, their shape, the grid, the kind and the time step
        (the encoder cache's key, and part of the prefix cache's: a video's time step
        moves its M-RoPE positions)."""
        h = hashlib.sha256(str(self.pixels.shape).encode())
        if self.grid_thw:
            h.update(f"{self.kind}{list(self.grid_thw)}{self.second_per_grid!r}".encode())
        h.update(self.pixels.tobytes())
        return h.digest()

    def media_input(self, offset: int, length: int) -> MediaInput:
        pixels = self.pixels
        return MediaInput(
            offset,
            length,
            self.content_hash,
            pixels.tobytes(),
            [*pixels.shape],
            kind=self.kind,
            grid_thw=list(self.grid_thw),
            second_per_grid=self.second_per_grid,
        )


@dataclass(frozen=True)
class QwenVLIntake:
    """How a Qwen2.5-VL checkpoint takes images and videos: its vision token ids and its
    image and video preprocessing (checked against ``vision_config``)."""

    image_token_id: int
    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    preprocess: QwenVLPreprocessor
    video_preprocess: QwenVLVideoPreprocessor

    @staticmethod
    def from_dir(
        model_dir: Path, raw: dict[str, Any], preprocessor: dict[str, Any]
    ) -> QwenVLIntake:
        """``raw``: ``config.json``; ``preprocessor``: ``preprocessor_config.json``.
        ``ValueError`` naming the file when the preprocessing does not fit the tower."""
        source = str(model_dir / "preprocessor_config.json")
        config = qwen_vl_config(raw, source=str(model_dir / "config.json"))
        image = QwenVLPreprocessor.from_dict(preprocessor, source)
        video = QwenVLVideoPreprocessor.from_dir(model_dir)
        vision = config.vision
        want = (int(vision["patch_size"]), config.merge, int(vision["temporal_patch_size"]))
        for name, pre in (("image", image), ("video", video)):
            got = (pre.patch_size, pre.merge_size, pre.temporal_patch_size)
            if got != want:
                raise ValueError(
                    f"{model_dir}: the {name} preprocessor's patch, merge and temporal patch "
                    f"sizes {got} differ from vision_config's {want}"
                )
        return QwenVLIntake(
            config.image_token_id,
            config.video_token_id,
            config.vision_start_token_id,
            config.vision_end_token_id,
            image,
            video,
        )

    def prompt_ids(
        self, tokenizer: Tokenizer, text: str, media: list[PreparedImage]
    ) -> tuple[list[int], list[MediaInput]]:
        """The rendered prompt's ids with every pad expanded, and one run per item."""
        text = self._markers_to_pads(tokenizer, text)
        ids = tokenizer.encode(text, add_special_tokens=False)
        queues = {
            self.image_token_id: [m for m in media if m.kind == "image"],
            self.video_token_id: [m for m in media if m.kind == "video"],
        }
        for token, items in queues.items():
            placed = ids.count(token)
            if placed != len(items):
                kind = "image" if token == self.image_token_id else "video"
                raise APIError.bad_request(
                    f"'messages': the prompt holds {placed} {tokenizer.token_text(token)!r} "
                    f"tokens for {len(items)} {kind}s (does the text hold the {kind} token?)",
                    param="messages",
                )
        out: list[int] = []
        runs: list[MediaInput] = []
        left = {token: iter(items) for token, items in queues.items()}
        for t in ids:
            if t not in left:
                out.append(t)
                continue
            item = next(left[t])
            runs.append(item.media_input(len(out), item.num_tokens))
            out += [t] * item.num_tokens
        return out, runs

    def _markers_to_pads(self, tokenizer: Tokenizer, text: str) -> str:
        """A string-content template's markers as ``<|vision_start|>PAD<|vision_end|>``."""
        if MEDIA_MARKER not in text and VIDEO_MARKER not in text:
            return text
        start, end = (
            tokenizer.token_text(self.vision_start_id),
            tokenizer.token_text(self.vision_end_id),
        )
        for token in (self.image_token_id, self.video_token_id):
            pad = tokenizer.token_text(token)
            if pad in text:
                raise APIError.bad_request(
                    f"'messages': the text holds the vision token {pad!r}", param="messages"
                )
        image = start + tokenizer.token_text(self.image_token_id) + end
        video = start + tokenizer.token_text(self.video_token_id) + end
        return text.replace(MEDIA_MARKER, image).replace(VIDEO_MARKER, video)
