"""Image parts on a text-only model (fake engine): a 400 naming the part, never reaching the
engine; ``/v1/models`` lists text only. A LLaVA whose chat template reads content parts
(llava-hf's) is sent what transformers renders. The media flags parse as vLLM spells
them and a bad value exits 2 naming the flag. (The model side is ``tests/vlm``.)"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import pytest
import transformers

from server.cli.args import build_parser
from server.media.multimodal import ImageModel, media_options
from server.text.tokenizer import Tokenizer
from tests.server.conftest import ServeFactory
from tests.vlm import llava_checkpoint as ckpt

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
    safe = media_options(_serve_args())
    assert (safe.allowed_media_domains, safe.allow_private_media_urls) == (None, False)
    opened = media_options(
        _serve_args(
            "--allowed-media-domains",
            "Images.Example.com.",
            "[::1]",
            "--allow-private-media-urls",
            "--media-memory-budget-mib",
            "64",
        )
    )
    assert opened.allowed_media_domains == frozenset({"images.example.com", "::1"})
    assert opened.allow_private_media_urls and opened.memory_budget_bytes == 64 * 2**20


@pytest.mark.parametrize(
    "flags",
    [
        ["--allowed-local-media-path", "/no/such/dir"],
        ["--media-fetch-timeout", "0"],
        ["--limit-mm-per-prompt", '{"audio": 1}'],
        ["--limit-mm-per-prompt", "image=many"],
        ["--allowed-media-domains", "example.com:8080"],
        ["--allowed-media-domains", "http://example.com/"],
        ["--media-memory-budget-mib", "0"],
    ],
)
def test_bad_media_flags_exit_2_naming_the_flag(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _serve_args(*flags)
    assert exit_info.value.code == 2
    assert flags[0] in capsys.readouterr().err


#: llava-hf/llava-1.5-7b-hf's template (its `{% generation %}` tags, a transformers
#: extension for assistant masks, left out): it reads content parts and writes `<image>`.
LLAVA_HF_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@pytest.fixture(scope="module")
def llava_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = ckpt.build(tmp_path_factory.mktemp("llava-hf-template") / "llava")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = LLAVA_HF_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


async def test_a_template_reading_content_parts_gets_them(
    serve: ServeFactory, llava_hf_dir: Path
) -> None:
    """The prompt the engine receives is transformers' rendering of the same parts (images
    as ``{"type": "image"}``), each image token expanded, its pixels the processor's."""
    tokenizer = Tokenizer.from_dir(llava_hf_dir)
    options = {"image_model": ImageModel.from_dir(llava_hf_dir)}
    served = await serve(served_tokenizer=tokenizer, app_options=options, vocab_size=1001)
    img = ckpt.image(5)
    url = "data:image/png;base64," + base64.b64encode(ckpt.encoded(img)).decode()
    content = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": url}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = await served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (rid,) = served.engine.batches[0]
    request = served.engine.requests[rid]
    hf = transformers.AutoTokenizer.from_pretrained(llava_hf_dir)
    parts = [{"type": "text", "text": "what is it"}, {"type": "image"}]
    text = hf.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    ids = hf(text, add_special_tokens=False)["input_ids"]
    at = ids.index(ckpt.IMAGE_TOKEN_ID)
    ids[at : at + 1] = [ckpt.IMAGE_TOKEN_ID] * ckpt.TOKENS_PER_IMAGE
    assert request.prompt_token_ids == ids
    (media,) = request.media
    assert (media.offset, media.length, media.shape) == (at, ckpt.TOKENS_PER_IMAGE, [3, 30, 30])
    assert media.pixels == ckpt.hf_pixels(llava_hf_dir, img).numpy().tobytes()
