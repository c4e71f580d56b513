"""Fetch and decode the images of a chat request: every bad input a 400 naming its part.

An ``image_url`` part's URL is one of

* ``data:image/png|jpeg|webp;base64,…``: decoded in place (another MIME type is a 400);
* ``file:///abs/path``: only under ``--allowed-local-media-path`` (the real path, links
  resolved; anything else, or no such flag, is a 400);
* ``http(s)://…``: fetched with ``--media-fetch-timeout`` seconds and at most
  :attr:`MediaOptions.max_bytes` bytes; a non-2xx status, a non-image content type, a
  connection failure or a timeout is a 400.

The bytes must hold a PNG, JPEG or WebP image (what the data URL declares, if it does)
of at most :attr:`MediaOptions.max_pixels` pixels (checked from the header, before
decoding); decoding (Pillow) and preprocessing run in a worker thread
(``asyncio.to_thread``), never on the event loop. vLLM's flag names throughout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlparse

import httpx
from PIL import Image, UnidentifiedImageError

from server.http.errors import APIError

#: MIME type → Pillow's format name, for the image types taken
IMAGE_MIMES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
#: the video types taken (a ``video_url`` part, :mod:`server.media.video`)
VIDEO_MIMES = ("video/mp4", "video/webm")
DEFAULT_MAX_BYTES = 20 * 2**20
DEFAULT_MAX_PIXELS = 40_000_000  # a 10k x 10k image is past it
DEFAULT_FETCH_TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class MediaOptions:
    """The serve flags that govern media (``--allowed-local-media-path``,
    ``--media-fetch-timeout``, ``--limit-mm-per-prompt``) and the size caps."""

    allowed_local_media_path: Path | None = None
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    limit_images: int = 4
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS  # per image, and per video frame
    limit_videos: int = 1
    video_fps: float = 2.0  # --video-fps
    max_video_frames: int = 32  # --max-video-frames


def bad_media(param: str, message: str) -> APIError:
    """The 400 for a bad media part ``param``."""
    return APIError.bad_request(f"'{param}': {message}", param=param, code="invalid_media")


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
    url: str, param: str, options: MediaOptions, preprocess: Callable[[Image.Image], T]
) -> T:
    """The image at ``url`` (the part ``param``), decoded and passed through ``preprocess``
    in a worker thread. :class:`APIError` (400 naming ``param``) on any bad input."""
    data, mime = await fetch_media(url, param, options)
    return await asyncio.to_thread(_decode_and_process, data, mime, param, options, preprocess)


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
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise bad_media(param, "a file URL must name a local path (file:///path)")
    path = Path(os.path.realpath(unquote(parsed.path)))
    if not path.is_relative_to(os.path.realpath(root)):
        raise bad_media(param, "the file is outside --allowed-local-media-path")
    if not path.is_file():
        raise bad_media(param, "no such file")
    if path.stat().st_size > options.max_bytes:
        raise bad_media(param, f"the file is larger than {options.max_bytes} bytes")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise bad_media(param, f"the file cannot be read ({exc.strerror})") from exc


def _mimes(kind: str) -> tuple[str, ...]:
    return VIDEO_MIMES if kind == "video" else tuple(IMAGE_MIMES)


_NAMES = {"image": "PNG, JPEG or WebP", "video": "MP4 or WebM"}


async def _http(url: str, param: str, options: MediaOptions, kind: str) -> tuple[bytes, str | None]:
    try:
        async with (
            httpx.AsyncClient(timeout=options.fetch_timeout_s, follow_redirects=True) as client,
            client.stream("GET", url) as response,
        ):
            if not response.is_success:
                raise bad_media(param, f"fetching the URL returned HTTP {response.status_code}")
            mime = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if mime and mime not in _mimes(kind) and mime != "application/octet-stream":
                raise bad_media(param, f"the URL serves {mime!r}, not a {_NAMES[kind]} {kind}")
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > options.max_bytes:
                    raise bad_media(param, f"the {kind} is larger than {options.max_bytes} bytes")
                chunks.append(chunk)
    except httpx.TimeoutException as exc:
        raise bad_media(param, f"fetching the URL timed out ({options.fetch_timeout_s} s)") from exc
    except httpx.HTTPError as exc:
        raise bad_media(param, f"the URL could not be fetched ({type(exc).__name__})") from exc
    return b"".join(chunks), mime if mime in _mimes(kind) else None


def _decode_and_process(
    data: bytes,
    mime: str | None,
    param: str,
    options: MediaOptions,
    preprocess: Callable[[Image.Image], T],
) -> T:
    image = decode_image(data, mime, param, options.max_pixels)
    return preprocess(image)


def decode_image(data: bytes, mime: str | None, param: str, max_pixels: int) -> Image.Image:
    """``data`` as a fully decoded PNG, JPEG or WebP image (of the declared ``mime``'s
    format when given), at most ``max_pixels`` pixels; else a 400 naming ``param``."""
    if not data:
        raise bad_media(param, "the image is empty (0 bytes)")
    formats = sorted(set(IMAGE_MIMES.values()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our cap is lower
            image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as exc:
        raise bad_media(param, f"the image has more than {max_pixels} pixels") from exc
    except UnidentifiedImageError as exc:
        raise bad_media(param, "the data is not a PNG, JPEG or WebP image") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise bad_media(param, f"the image is {width}x{height}, more than {max_pixels} pixels")
    if mime is not None and IMAGE_MIMES[mime] != image.format:
        raise bad_media(param, f"declared {mime} but the data is a {image.format} image")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise bad_media(param, f"the image cannot be decoded ({exc})") from exc
    return image
