"""Image parts on a text-only model (fake engine): a 400 naming the part, never reaching the
engine; ``/v1/models`` lists text only. The media flags parse as vLLM spells them and a
bad value exits 2 naming the flag. (The vision-language side is ``tests/vlm``.)"""

from __future__ import annotations

import argparse
import base64

import pytest

from server.cli_args import build_parser
from server.multimodal import media_options
from tests.server.conftest import ServeFactory

pytestmark = pytest.mark.timeout(60)

PNG_1X1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


async def test_text_only_model_refuses_an_image(serve: ServeFactory) -> None:
    served = await serve()
    url = "data:image/png;base64," + base64.b64encode(PNG_1X1).decode()
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = await served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]"
    assert error["code"] == "modality_not_supported"
    assert not served.engine.batches, "the request reached the engine"
    text_only = {"messages": [{"role": "user", "content": content[:1]}], "max_tokens": 2}
    assert (await served.http.post("/v1/chat/completions", json=text_only)).status_code == 200
    card = (await served.http.get("/v1/models")).json()["data"][0]
    assert card["modalities"] == ["text"]


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_media_flags_parse_as_vllm_spells_them(tmp_path: object) -> None:
    assert media_options(_serve_args()).allowed_local_media_path is None
    opts = media_options(
        _serve_args(
            "--allowed-local-media-path",
            str(tmp_path),
            "--media-fetch-timeout",
            "2.5",
            "--limit-mm-per-prompt",
            '{"image": 3}',
        )
    )
    assert (opts.fetch_timeout_s, opts.limit_images) == (2.5, 3)
    assert media_options(_serve_args("--limit-mm-per-prompt", "image=1")).limit_images == 1


@pytest.mark.parametrize(
    "flags",
    [
        ["--allowed-local-media-path", "/no/such/dir"],
        ["--media-fetch-timeout", "0"],
        ["--limit-mm-per-prompt", '{"audio": 1}'],
        ["--limit-mm-per-prompt", "image=many"],
    ],
)
def test_bad_media_flags_exit_2_naming_the_flag(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _serve_args(*flags)
    assert exit_info.value.code == 2
    assert flags[0] in capsys.readouterr().err
