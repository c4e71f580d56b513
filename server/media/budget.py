"""What decoding a request's media may cost: pixels after the model's resize, and bytes.

* Pillow's own decompression-bomb limit is set to :data:`DEFAULT_MAX_PIXELS` (refused at
  twice that, from the header, before decoding);
* an image (or a video's frames) of at most :attr:`MediaOptions.max_pixels` pixels as
  decoded, and as resized for the model (checked from the header, before decoding: a
  1x100000 PNG is refused for what the CLIP resize would make of it);
* :class:`MediaBudget`: the bytes one request's images and videos may take once decoded
  and resized (``--media-memory-budget-mib``), charged before each is decoded; the parts
  of a request share it (they decode concurrently, in worker threads).

Every refusal is a 400 naming the part.
"""

from __future__ import annotations

import threading

from PIL import Image

from server.http.errors import APIError

DEFAULT_MAX_PIXELS = 40_000_000  # a 10k x 10k image is past it
DEFAULT_MEMORY_BUDGET_MIB = 1024
#: Bytes counted per decoded pixel (up to RGBA) and per resized pixel (the uint8 image,
#: the float32 channels, a second copy for Qwen's temporal patch)
DECODED_PIXEL_BYTES = 4
RESIZED_PIXEL_BYTES = 3 + 2 * 3 * 4

Image.MAX_IMAGE_PIXELS = DEFAULT_MAX_PIXELS  # Pillow refuses past twice this itself


def bad_media(param: str, message: str) -> APIError:
    """The 400 for a bad media part ``param``."""
    return APIError.bad_request(f"'{param}': {message}", param=param, code="invalid_media")


def check_resized(
    param: str, what: str, size: tuple[int, int], resized: tuple[int, int], max_pixels: int
) -> None:
    """A 400 naming ``param`` when ``size`` (width, height as decoded) or ``resized`` (as
    the model's preprocessing would make it) has more than ``max_pixels`` pixels."""
    (width, height), (new_w, new_h) = size, resized
    if width * height > max_pixels:
        raise bad_media(param, f"the {what} is {width}x{height}, more than {max_pixels} pixels")
    if new_w * new_h > max_pixels:
        raise bad_media(
            param,
            f"the {what} is {width}x{height}; this model resizes it to {new_w}x{new_h}, "
            f"more than {max_pixels} pixels",
        )


class MediaBudget:
    """The decoded bytes one request's media may take (see the module docstring);
    thread-safe, never given back (it lives as long as the request's preprocessing)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()

    def charge(self, param: str, nbytes: int) -> None:
        """Take ``nbytes`` for the part ``param``, or raise its 400 past the budget."""
        with self._lock:
            if self.used_bytes + nbytes > self.limit_bytes:
                raise bad_media(
                    param,
                    f"decoding it takes about {nbytes} bytes; the media of one request may "
                    f"take {self.limit_bytes} (--media-memory-budget-mib)",
                )
            self.used_bytes += nbytes


def image_bytes(size: tuple[int, int], resized: tuple[int, int]) -> int:
    """What decoding an image of ``size`` and resizing it to ``resized`` is charged."""
    return size[0] * size[1] * DECODED_PIXEL_BYTES + resized[0] * resized[1] * RESIZED_PIXEL_BYTES


def out_of_memory(param: str) -> APIError:
    """The 400 of a part whose decoding ran out of memory."""
    return bad_media(param, "the server has not the memory to decode it")
