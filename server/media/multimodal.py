"""Images and videos in chat prompts: which models take them, the serve flags, and the
prompt's placeholders expanded in the frontend.

:meth:`ImageModel.from_dir` reads a vision-language checkpoint's ``config.json``
(:mod:`model_shards.config.vlm`, no torch) and ``preprocessor_config.json``, and picks
the preprocessing by its ``image_processor_type`` (the architecture's when it names
none): CLIP's (:mod:`server.media.image`) for LLaVA, Qwen2-VL's
(:mod:`server.media.qwen2_5_vl.image`, videos :mod:`server.media.qwen2_5_vl.video`) for
Qwen2.5-VL; a
text-only checkpoint has none, and any image sent to it is a 400. For a chat request,
:func:`load_chat_images` fetches and preprocesses every image part and, for a model that
takes videos, every video part (:mod:`server.media.fetch`, :mod:`server.media.video`, concurrently,
off the event loop); :func:`prompt_ids` puts the model's image token where each image's
marker is in the rendered prompt, tokenizes, and repeats each image token once per
embedding the vision tower emits (LLaVA: a fixed count; Qwen2.5-VL: each item's own,
:mod:`server.media.qwen2_5_vl.prompt`), each run described by a
:class:`~model_shards.messages.MediaInput` (pixels as raw float32 bytes, a SHA-256 content
hash of them) that travels with the request to the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
from PIL import Image

from model_shards.config.qwen2_5_vl import is_qwen_vl
from model_shards.config.vlm import is_vlm, llava_config
from model_shards.messages import GenerateRequest, MediaInput
from server.api.chat_protocol import ChatCompletionRequest
from server.cli.flag_types import positive_float, positive_int
from server.http.errors import APIError
from server.media.budget import DEFAULT_MEMORY_BUDGET_MIB, bad_media, out_of_memory
from server.media.fetch import (
    DEFAULT_FETCH_TIMEOUT_S,
    MediaOptions,
    check_part_count,
    load_image,
)
from server.media.image import CLIP_PROCESSORS, ClipPreprocessor, read_preprocessor_config
from server.media.parts import MEDIA_MARKER
from server.media.qwen2_5_vl.image import QWEN_VL_PROCESSORS, QwenVLImage
from server.media.qwen2_5_vl.prompt import PreparedImage as PreparedImage  # chat.py's import
from server.media.qwen2_5_vl.prompt import QwenVLIntake
from server.media.video import (
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_VIDEO_FPS,
    VideoInput,
    load_chat_videos,
)
from server.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ImageModel:
    """How a vision-language model takes images: its image token, the placeholders per
    image (LLaVA's fixed count; 0 for Qwen2.5-VL, whose ``qwen`` intake counts each
    item's), its preprocessing."""

    image_token_id: int
    tokens_per_image: int
    preprocess: ClipPreprocessor | QwenVLIntake
    takes_video: bool = False  # video parts reach load_chat_videos (server.media.video)

    @property
    def qwen(self) -> QwenVLIntake | None:
        return self.preprocess if isinstance(self.preprocess, QwenVLIntake) else None

    @staticmethod
    def from_dir(model_dir: str | Path) -> ImageModel | None:
        """``None`` for a text-only checkpoint; ``ValueError`` naming the file otherwise
        when its configs cannot be read or its preprocessing does not fit the model."""
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None  # the replica's own config check names the problem
        if not is_vlm(raw):
            return None
        pre_path = Path(model_dir) / "preprocessor_config.json"
        preprocessor = read_preprocessor_config(pre_path)
        qwen = is_qwen_vl(raw)
        kind = preprocessor.get("image_processor_type")
        kind = kind or (QWEN_VL_PROCESSORS[0] if qwen else CLIP_PROCESSORS[0])
        want = QWEN_VL_PROCESSORS if qwen else CLIP_PROCESSORS
        if kind not in want:
            arch = "Qwen2.5-VL" if qwen else "LLaVA"
            raise ValueError(f"{pre_path}: image_processor_type {kind!r} is not {arch}'s")
        if qwen:
            intake = QwenVLIntake.from_dir(Path(model_dir), raw, preprocessor)
            return ImageModel(intake.image_token_id, 0, intake, takes_video=True)
        llava = llava_config(raw, str(path))
        preprocess = ClipPreprocessor.from_dict(preprocessor, str(pre_path))
        if preprocess.crop_hw != (llava.vision.image_size,) * 2:
            raise ValueError(
                f"{model_dir}: preprocessor_config.json crops {preprocess.crop_hw}, the vision "
                f"tower takes {llava.vision.image_size}x{llava.vision.image_size} images"
            )
        return ImageModel(llava.image_token_id, llava.tokens_per_image, preprocess)

    @property
    def modalities(self) -> list[str]:
        return ["text", "image", "video"] if self.takes_video else ["text", "image"]


def has_media(body: ChatCompletionRequest) -> bool:
    """Whether ``body`` holds an image or video part (something to fetch or decode)."""
    return any(message.media for message in body.messages)


async def load_chat_images(
    body: ChatCompletionRequest, model: ImageModel | None, options: MediaOptions
) -> list[PreparedImage]:
    """Every image part of ``body`` in prompt order, preprocessed, then (a model that
    takes videos) every video part; a 400 naming the part when it is bad, when the model
    takes no images or videos, or past ``--limit-mm-per-prompt`` (counted before anything
    is fetched) or the request's decoded-bytes budget."""
    parts = media_parts(body, "image")
    refusal = "this model takes text only, not images" if model is None else None
    check_part_count(parts, "image", refusal, options.limit_images)
    budget = options.budget()
    qwen = model.qwen if model is not None else None
    resize = qwen.video_preprocess if qwen is not None else None
    takes_video = bool(model and model.takes_video)
    videos = await load_chat_videos(
        media_parts(body, "video"), takes_video, options, resize, budget
    )
    if model is None:
        return []
    if qwen is None:
        clip = cast(ClipPreprocessor, model.preprocess)
        pixels = await asyncio.gather(
            *(
                load_image(url, f"{p}.image_url", options, clip, clip.output_size, budget)
                for p, url in parts
            )
        )
        return [PreparedImage(p) for p in pixels]
    size = qwen.preprocess.output_size
    images = await asyncio.gather(
        *(
            load_image(url, f"{p}.image_url", options, _qwen_image(qwen, p), size, budget)
            for p, url in parts
        )
    )
    clips = await asyncio.gather(*(asyncio.to_thread(_qwen_video, qwen, v) for v in videos))
    return [*images, *clips]


def _qwen_image(qwen: QwenVLIntake, param: str) -> Callable[[Image.Image], PreparedImage]:
    """Qwen2-VL's image preprocessing for the part ``param`` (a 400 naming it when the
    image cannot be resized, e.g. an aspect ratio past 200)."""

    def run(image: Image.Image) -> PreparedImage:
        try:
            out: QwenVLImage = qwen.preprocess(image)
        except ValueError as exc:
            raise bad_media(
                f"{param}.image_url", f"the image cannot be preprocessed ({exc})"
            ) from exc
        return PreparedImage(out.pixels, "image", out.grid_thw, 0.0, out.num_tokens)

    return run


def _qwen_video(qwen: QwenVLIntake, video: VideoInput) -> PreparedImage:
    """One decoded video part through Qwen2-VL's video preprocessing (worker thread)."""
    try:
        out = qwen.video_preprocess(video.frames, video.fps)
    except ValueError as exc:
        raise bad_media(video.param, f"the video cannot be preprocessed ({exc})") from exc
    except MemoryError as exc:
        raise out_of_memory(video.param) from exc
    return PreparedImage(out.pixels, "video", out.grid_thw, out.second_per_grid, out.num_tokens)


def media_parts(body: ChatCompletionRequest, kind: str) -> list[tuple[str, str]]:
    """``(param, url)`` of each ``kind`` ("image", "video") part of ``body``, in order."""
    return [
        (f"messages[{i}].content[{part.index}]", part.url)
        for i, message in enumerate(body.messages)
        for part in message.media
        if part.kind == kind
    ]


def prompt_ids(
    tokenizer: Tokenizer, text: str, images: list[PreparedImage], model: ImageModel | None
) -> tuple[list[int], list[MediaInput]]:
    """The rendered prompt's ids with each image's placeholder run, and the runs."""
    if model is not None and model.qwen is not None:
        return model.qwen.prompt_ids(tokenizer, text, images)
    if not images or model is None:
        return tokenizer.encode(text, add_special_tokens=False), []
    token = tokenizer.token_text(model.image_token_id)
    markers = text.count(MEDIA_MARKER)
    if markers and token in text:
        raise APIError.bad_request(
            f"'messages': the text holds the image token {token!r}", param="messages"
        )
    placed = markers or text.count(token)  # markers: string content; else the template's
    if placed != len(images):
        raise APIError.bad_request(
            f"'messages': the chat template placed {placed} image tokens for {len(images)} "
            "images (does the text hold the image token?)",
            param="messages",
        )
    ids = tokenizer.encode(text.replace(MEDIA_MARKER, token), add_special_tokens=False)
    out: list[int] = []
    media: list[MediaInput] = []
    images_left = iter(images)
    for t in ids:
        if t != model.image_token_id:
            out.append(t)
            continue
        image = next(images_left)
        media.append(image.media_input(len(out), model.tokens_per_image))
        out += [t] * model.tokens_per_image
    return out, media


_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b|selectattr\(\s*['"]type['"]""")


@functools.lru_cache(maxsize=8)
def reads_content_parts(template: str) -> bool:
    """Whether a chat template reads content parts itself (vLLM's "openai" content format,
    llava-hf's and Qwen2-VL's templates): it looks at a part's ``type``."""
    return bool(_PARTS.search(template))


def template_messages(
    tokenizer: Tokenizer, body: ChatCompletionRequest, model: ImageModel | None
) -> list[dict[str, Any]]:
    """``body``'s messages as the chat template takes them: for a vision-language model
    whose template reads content parts, list contents as parts (images ``{"type":
    "image"}``: the template writes the image token); else content strings (the markers
    of :mod:`server.media.parts` where the images go)."""
    source = tokenizer.chat_template
    parts = model is not None and source is not None and reads_content_parts(source)
    return [m.template_dict(content_parts=parts) for m in body.messages]


def with_media(requests: list[GenerateRequest], media: list[MediaInput]) -> list[GenerateRequest]:
    """Each request carrying the prompt's images (unchanged when there are none)."""
    if not media:
        return requests
    return [msgspec.structs.replace(r, media=media) for r in requests]


def add_media_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's media flags on ``shardserve serve`` (and ours for the decoding budget)."""
    _add_fetch_flags(parser)
    parser.add_argument(
        "--media-memory-budget-mib",
        type=positive_int,
        default=DEFAULT_MEMORY_BUDGET_MIB,
        metavar="MIB",
        help="most memory one request's images and videos may take decoded and resized",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=_limit,
        default={},
        metavar="JSON",
        help="most images / videos one prompt may hold (JSON as vLLM's, or image=N,video=M)",
    )
    parser.add_argument(
        "--video-fps",
        type=positive_float,
        default=DEFAULT_VIDEO_FPS,
        metavar="F",
        help="frames per second sampled from a video part (vLLM's name)",
    )
    parser.add_argument(
        "--max-video-frames",
        type=positive_int,
        default=DEFAULT_MAX_VIDEO_FRAMES,
        metavar="N",
        help="most frames kept of one video, spread over it past that",
    )


def _add_fetch_flags(parser: argparse.ArgumentParser) -> None:
    """Where media URLs may be read from (vLLM's names)."""
    parser.add_argument(
        "--allowed-local-media-path",
        type=_directory,
        default=None,
        metavar="DIR",
        help="file:// image URLs may name files under DIR (default: none may)",
    )
    parser.add_argument(
        "--media-fetch-timeout",
        type=positive_float,
        default=DEFAULT_FETCH_TIMEOUT_S,
        metavar="S",
        help="seconds one http(s) media URL may take to fetch, redirects and body included",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        type=_domain,
        default=None,
        metavar="DOMAIN",
        help="http(s) media URLs (and their redirects) may name only these hosts "
        "(default: any public host)",
    )
    parser.add_argument(
        "--allow-private-media-urls",
        action="store_true",
        help="let http(s) media URLs reach private, loopback and link-local addresses "
        "(internal deployments only: any client can then probe your network)",
    )


def media_options(args: argparse.Namespace) -> MediaOptions:
    return MediaOptions(
        allowed_local_media_path=args.allowed_local_media_path,
        fetch_timeout_s=args.media_fetch_timeout,
        allowed_media_domains=(
            None if args.allowed_media_domains is None else frozenset(args.allowed_media_domains)
        ),
        allow_private_media_urls=args.allow_private_media_urls,
        memory_budget_bytes=args.media_memory_budget_mib * 2**20,
        limit_images=args.limit_mm_per_prompt.get("image", MediaOptions.limit_images),
        limit_videos=args.limit_mm_per_prompt.get("video", MediaOptions.limit_videos),
        video_fps=args.video_fps,
        max_video_frames=args.max_video_frames,
    )


def _directory(value: str) -> Path:
    path = Path(value)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is not a directory")
    return path.resolve()


def _domain(value: str) -> str:
    """A host name as URLs carry it (lower case, no trailing dot)."""
    host = value.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
    if not host or any(c in host for c in "/@ ?#") or (":" in host and not _is_ip(host)):
        raise argparse.ArgumentTypeError(f"{value!r} is not a host name (e.g. images.example.com)")
    return host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _limit(value: str) -> dict[str, int]:
    """``'{"image": 2, "video": 1}'`` or ``image=2,video=1`` → the per-modality limits."""
    try:
        parsed = json.loads(value) if value.strip().startswith("{") else None
        if parsed is None:
            parsed = dict(item.split("=", 1) for item in value.split(","))
        limits = {str(k): int(v) for k, v in parsed.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(
            f'use {{"image": N, "video": M}} or image=N,video=M, got {value!r}'
        ) from exc
    unknown = sorted(set(limits) - {"image", "video"})
    if unknown or min(limits.values(), default=0) < 0:
        raise argparse.ArgumentTypeError(
            f"only non-negative 'image' and 'video' limits are served: {value!r}"
        )
    return limits
