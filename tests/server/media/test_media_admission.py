"""Nothing is fetched for a request the server would refuse anyway (issue #41): an image URL
in a chat request to an unknown model (404), a replica that is not ready (503) or a full
queue (429) never reaches its origin; an admitted one does (the control)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from server.http.limits import Admission
from server.media.fetch import MediaOptions
from server.media.image import ClipPreprocessor
from server.media.multimodal import ImageModel
from tests.server.conftest import ServeFactory
from tests.server.media.origin import Origin, running_origin

pytestmark = pytest.mark.timeout(60)

CLIP = ClipPreprocessor.from_dict({"size": {"shortest_edge": 8}, "crop_size": 8}, "clip")
OPTIONS = {
    "image_model": ImageModel(image_token_id=5, tokens_per_image=1, preprocess=CLIP),
    "media_options": MediaOptions(allow_private_media_urls=True),
}


@pytest.fixture
def origin() -> Iterator[Origin]:
    with running_origin() as running:
        yield running


def _body(origin: Origin, model: str = "tiny") -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": f"{origin.url}/good.png"}}
    return {"model": model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}


async def test_unknown_model_fetches_nothing(serve: ServeFactory, origin: Origin) -> None:
    served = await serve(app_options=OPTIONS)
    response = await served.http.post("/v1/chat/completions", json=_body(origin, "nope"))
    assert response.status_code == 404 and origin.paths == []
    await served.http.post("/v1/chat/completions", json=_body(origin))
    assert origin.paths == ["/good.png"]  # admitted: fetched


async def test_engine_not_ready_fetches_nothing(serve: ServeFactory, origin: Origin) -> None:
    served = await serve(ready=False, wait_ready=False, app_options=OPTIONS)
    response = await served.http.post("/v1/chat/completions", json=_body(origin))
    assert response.status_code == 503 and origin.paths == []


async def test_shed_load_fetches_nothing(serve: ServeFactory, origin: Origin) -> None:
    served = await serve(app_options={**OPTIONS, "admission": Admission(max_requests=0)})
    response = await served.http.post("/v1/chat/completions", json=_body(origin))
    assert response.status_code == 429 and origin.paths == []
