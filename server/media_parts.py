"""Media content parts of chat messages, taken out before the message is validated as text.

``{"type": "image_url", "image_url": {"url": URL}}`` (or ``"image_url": URL``, as vLLM
accepts) becomes :class:`MediaPart` on the message's ``media`` and, in the content, a
text part holding :data:`MEDIA_MARKER`, so the message joins to text as before and the
rendered prompt shows where each image goes (:mod:`server.multimodal` puts the model's
image placeholder there). For a chat template that reads content parts itself (llava-hf's,
Qwen2-VL's) the message also keeps ``content_parts``: its parts with each image as
``{"type": "image"}``, as transformers' processors pass them. Only the part's shape is
checked here (a 400 naming it); fetching and decoding are :mod:`server.media`'s.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

#: Stands for one image in rendered text; text that holds it itself is refused.
MEDIA_MARKER = "<|shardserve-image|>"
MEDIA_PART_TYPES = ("image_url",)


class MediaPart(BaseModel):
    """One image of a message: ``content[index]`` of it, and its URL."""

    index: int
    url: str


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
            media.append(MediaPart(index=j, url=_url_of(part, j)))
            content.append({"type": "text", "text": MEDIA_MARKER})
            parts.append({"type": "image"})
        else:
            if isinstance(part, dict) and MEDIA_MARKER in str(part.get("text", "")):
                raise PydanticCustomError(
                    "value_error", "content[{j}].text holds a reserved marker", {"j": j}
                )
            content.append(part)
            parts.append(part)
    return {**data, "content": content, "media": media, "content_parts": parts}


def _url_of(part: dict[str, Any], j: int) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise PydanticCustomError(
            "value_error",
            "content[{j}].image_url needs a 'url' (a data:, file: or http(s): URL)",
            {"j": j},
        )
    return url
