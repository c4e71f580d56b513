"""Fetch and decode the images of a chat request: every bad input a 400 naming its part.

An ``image_url`` part's URL is one of

* ``data:image/png|jpeg|webp;base64,…``: decoded in place (another MIME type is a 400);
* ``file:///abs/path``: only under ``--allowed-local-media-path`` (the real path, links
  resolved; anything else, or no such flag, is a 400; so is a null byte or a path that is
  not UTF-8);
* ``http(s)://…``: fetched by :mod:`server.media.http_fetch` (``--allowed-media-domains``,
  public addresses only unless ``--allow-private-media-urls``, redirects checked hop by
  hop, ``--media-fetch-timeout`` for the whole fetch, at most
  :attr:`MediaOptions.max_bytes`); any failure is the same 400, "could not fetch", its
  reason only in the log.

The bytes must hold a PNG, JPEG or WebP image (what the data URL declares, if it does)
within :mod:`server.media.budget`'s limits (pixels as decoded and as the model resizes
them, the request's decoded bytes: all checked from the header, before decoding);
decoding (Pillow) and preprocessing run in a worker thread (``asyncio.to_thread``),
never on the event loop. vLLM's flag names throughout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

from server.http.errors import APIError
from server.media.budget import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MEMORY_BUDGET_MIB,
    MediaBudget,
    bad_media,
    check_resized,
    image_bytes,
    out_of_memory,
)
from server.media.http_fetch import FetchFailed, FetchPolicy, HostNotAllowed, Resolver, fetch_url

logger = logging.getLogger(__name__)

#: MIME type → Pillow's format name, for the image types taken
IMAGE_MIMES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
#: the video types taken (a ``video_url`` part, :mod:`server.media.video`)
VIDEO_MIMES = ("video/mp4", "video/webm")
DEFAULT_MAX_BYTES = 20 * 2**20
DEFAULT_FETCH_TIMEOUT_S = 5.0

T = TypeVar("T")
#: ``(width, height)`` as decoded → as the model's preprocessing resizes it (``ValueError``
#: when it cannot)
Resize = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True)
class MediaOptions:
    """The serve flags that govern media (``--allowed-local-media-path``,
    ``--media-fetch-timeout``, ``--allowed-media-domains``, ``--allow-private-media-urls``,
    ``--limit-mm-per-prompt``, ``--media-memory-budget-mib``) and the size caps.
    ``resolve``: the http fetch's resolver (``None``: DNS, public addresses only)."""

    allowed_local_media_path: Path | None = None
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    allowed_media_domains: frozenset[str] | None = None
    allow_private_media_urls: bool = False
    limit_images: int = 4
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS  # per image, and per video frame
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_MIB * 2**20  # per request
    limit_videos: int = 1
    video_fps: float = 2.0  # --video-fps
    max_video_frames: int = 32  # --max-video-frames
    resolve: Resolver | None = None

    def budget(self) -> MediaBudget:
        """A new request's decoded-bytes budget."""
        return MediaBudget(self.memory_budget_bytes)


def check_part_count(
    parts: list[tuple[str, str]], kind: str, refusal: str | None, limit: int
) -> None:
    """A 400 naming the first of ``parts`` (``(param, url)``) when the model refuses
    ``kind`` parts (``refusal``: why, e.g. "this model does not take videos"), or when there
    are more than ``limit`` of them (``--limit-mm-per-prompt``)."""
    if not parts:
        return
    if refusal is not None:
        param = parts[0][0]
        raise APIError.bad_request(
            f"'{param}': {refusal}", param=param, code="modality_not_supported"
        )
    if len(parts) > limit:
        raise APIError.bad_request(
            f"'messages': {len(parts)} {kind}s, at most {limit} per prompt (--limit-mm-per-prompt)",
            param="messages",
        )


async def load_image(
    url: str,
    param: str,
    options: MediaOptions,
    preprocess: Callable[[Image.Image], T],
    resize: Resize | None = None,
    budget: MediaBudget | None = None,
) -> T:
    """The image at ``url`` (the part ``param``), decoded and passed through ``preprocess``
    in a worker thread; ``resize``: the size ``preprocess`` resizes to (checked against
    the pixel cap before decoding), ``budget``: the request's. :class:`APIError` (400
    naming ``param``) on any bad input."""
    data, mime = await fetch_media(url, param, options)
    budget = budget or options.budget()
    return await asyncio.to_thread(
        _decode_and_process, data, mime, param, options, preprocess, resize, budget
    )


async def fetch_media(
    url: str, param: str, options: MediaOptions, kind: str = "image"
) -> tuple[bytes, str | None]:
    """The URL's bytes and the MIME type it declares (``None``: a local file); ``kind``
    (``"image"`` or ``"video"``) says which MIME types are taken."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, param, options, kind)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, param, options), None
    if scheme in ("http", "https"):
        return await _http(url, param, options, kind)
    raise bad_media(param, "the URL must be a data:, file: or http(s): URL")


def _data_url(url: str, param: str, options: MediaOptions, kind: str) -> tuple[bytes, str]:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise bad_media(param, "a data URL needs a ',' before its data")
    mime, *params = header.split(";")
    mime = mime.strip().lower()
    if mime not in _mimes(kind):
        raise bad_media(param, f"unsupported MIME type {mime or '(none)'!r}; send {_NAMES[kind]}")
    if "base64" not in params:
        raise bad_media(param, "the data URL must be base64-encoded (';base64,')")
    if len(payload) * 3 // 4 > options.max_bytes:
        raise bad_media(param, f"the {kind} is larger than {options.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True), mime
    except (binascii.Error, ValueError) as exc:
        raise bad_media(param, f"invalid base64 data ({exc})") from exc


def _local_file(url: str, param: str, options: MediaOptions) -> bytes:
    root = options.allowed_local_media_path
    if root is None:
        raise bad_media(param, "local files are not served; start with --allowed-local-media-path")
    try:
        parsed = urlparse(url)
        name = unquote(parsed.path, errors="strict")
    except (ValueError, UnicodeError) as exc:
        raise bad_media(param, "the file URL is not valid (its path must be UTF-8)") from exc
    if parsed.netloc not in ("", "localhost"):
        raise bad_media(param, "a file URL must name a local path (file:///path)")
    if "\x00" in name:
        raise bad_media(param, "the file URL holds a null byte")
    try:
        path = Path(os.path.realpath(name))
        if not path.is_relative_to(os.path.realpath(root)):
            raise bad_media(param, "the file is outside --allowed-local-media-path")
        if not path.is_file():
            raise bad_media(param, "no such file")
        if path.stat().st_size > options.max_bytes:
            raise bad_media(param, f"the file is larger than {options.max_bytes} bytes")
        return path.read_bytes()
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "invalid path"
        raise bad_media(param, f"the file cannot be read ({reason})") from exc


def _mimes(kind: str) -> tuple[str, ...]:
    return VIDEO_MIMES if kind == "video" else tuple(IMAGE_MIMES)


_NAMES = {"image": "PNG, JPEG or WebP", "video": "MP4 or WebM"}


async def _http(url: str, param: str, options: MediaOptions, kind: str) -> tuple[bytes, str | None]:
    """The body at ``url``; one generic 400 for any failure past the URL's own checks."""
    policy = FetchPolicy(
        options.allowed_media_domains,
        options.allow_private_media_urls,
        options.fetch_timeout_s,
        options.max_bytes,
        _mimes(kind),
        options.resolve,
    )
    try:
        data, mime = await fetch_url(url, policy)
    except HostNotAllowed as exc:
        raise bad_media(param, "the URL's host is not in --allowed-media-domains") from exc
    except ValueError as exc:
        raise bad_media(param, f"the URL is {exc}") from exc
    except FetchFailed as exc:
        logger.info("fetching %s failed: %s", param, exc)
        raise bad_media(param, f"could not fetch the {kind} URL") from exc
    return data, mime if mime in _mimes(kind) else None


def _decode_and_process(
    data: bytes,
    mime: str | None,
    param: str,
    options: MediaOptions,
    preprocess: Callable[[Image.Image], T],
    resize: Resize | None,
    budget: MediaBudget,
) -> T:
    try:
        image = decode_image(data, mime, param, options.max_pixels, resize, budget)
        return preprocess(image)
    except MemoryError as exc:
        raise out_of_memory(param) from exc


def decode_image(
    data: bytes,
    mime: str | None,
    param: str,
    max_pixels: int,
    resize: Resize | None = None,
    budget: MediaBudget | None = None,
) -> Image.Image:
    """``data`` as a fully decoded PNG, JPEG or WebP image (of the declared ``mime``'s
    format when given), at most ``max_pixels`` pixels as decoded and as ``resize`` makes
    it, charged to ``budget`` before decoding; else a 400 naming ``param``."""
    if not data:
        raise bad_media(param, "the image is empty (0 bytes)")
    formats = sorted(set(IMAGE_MIMES.values()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below
            image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as exc:
        raise bad_media(param, f"the image has more than {max_pixels} pixels") from exc
    except UnidentifiedImageError as exc:
        raise bad_media(param, "the data is not a PNG, JPEG or WebP image") from exc
    if mime is not None and IMAGE_MIMES[mime] != image.format:
        raise bad_media(param, f"declared {mime} but the data is a {image.format} image")
    resized = _resized(image.size, resize, param)
    check_resized(param, "image", image.size, resized, max_pixels)
    if budget is not None:
        budget.charge(param, image_bytes(image.size, resized))
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise bad_media(param, f"the image cannot be decoded ({exc})") from exc
    return image


def _resized(size: tuple[int, int], resize: Resize | None, param: str) -> tuple[int, int]:
    if resize is None:
        return size
    try:
        return resize(*size)
    except (ValueError, ZeroDivisionError) as exc:
        raise bad_media(param, f"the image cannot be preprocessed ({exc})") from exc
