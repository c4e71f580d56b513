"""Media content parts of chat messages, taken out before the message is validated as text.

``{"type": "image_url", "image_url": {"url": URL}}`` (or ``"image_url": URL``, as vLLM
accepts) becomes :class:`MediaPart` on the message's ``media`` and, in the content, a
text part holding :data:`MEDIA_MARKER`, so the message joins to text as before and the
rendered prompt shows where each image goes (:mod:`server.media.multimodal` puts the model's
image placeholder there). For a chat template that reads content parts itself (llava-hf's,
Qwen2-VL's) the message also keeps ``content_parts``: its parts with each image as
``{"type": "image"}``, as transformers' processors pass them. Only the part's shape is
checked here (a 400 naming it); fetching and decoding are :mod:`server.media.fetch`'s.

``{"type": "video_url", "video_url": {"url": URL}}`` (vLLM's extension) is the same with
``kind="video"``, :data:`VIDEO_MARKER` and ``{"type": "video"}``; decoding is
:mod:`server.media.video`'s.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

#: Stands for one image in rendered text; text that holds it itself is refused.
MEDIA_MARKER = "<|shardserve-image|>"
#: Stands for one video in rendered text, as :data:`MEDIA_MARKER` for an image.
VIDEO_MARKER = "<|shardserve-video|>"
MEDIA_PART_TYPES = ("image_url", "video_url")
_MARKERS = {"image": MEDIA_MARKER, "video": VIDEO_MARKER}


class MediaPart(BaseModel):
    """One image or video of a message: ``content[index]`` of it, its URL, its kind."""

    index: int
    url: str
    kind: str = "image"  # "image" or "video"


def split_media_parts(data: Any) -> Any:
    """A raw message with its media parts moved to ``media`` (markers left in ``content``);
    anything else unchanged. Raises a validation error naming a malformed part."""
    if not isinstance(data, dict):
        return data
    if not isinstance(data.get("content"), list):
        return {**data, "media": [], "content_parts": None}  # never from the client
    content, media, parts = [], [], []
    for j, part in enumerate(data["content"]):
        if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
            kind = str(part["type"]).removesuffix("_url")
            media.append(MediaPart(index=j, url=_url_of(part, j, kind), kind=kind))
            content.append({"type": "text", "text": _MARKERS[kind]})
            parts.append({"type": kind})
        else:
            text = str(part.get("text", "")) if isinstance(part, dict) else ""
            if MEDIA_MARKER in text or VIDEO_MARKER in text:
                raise PydanticCustomError(
                    "value_error", "content[{j}].text holds a reserved marker", {"j": j}
                )
            content.append(part)
            parts.append(part)
    return {**data, "content": content, "media": media, "content_parts": parts}


def _url_of(part: dict[str, Any], j: int, kind: str) -> str:
    value = part.get(f"{kind}_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise PydanticCustomError(
            "value_error",
            "content[{j}].{kind}_url needs a 'url' (a data:, file: or http(s): URL)",
            {"j": j, "kind": kind},
        )
    return url
