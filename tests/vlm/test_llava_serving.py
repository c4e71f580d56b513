"""A live ``shardserve serve`` of the tiny LLaVA: the official ``openai`` SDK sends a base64
image and gets what ``transformers`` generates for the same prompt; the same image by
``file://`` (under ``--allowed-local-media-path``) and from a local HTTP server gives the
same answer; ``/v1/models`` lists the image modality; every kind of bad media input is a
400 naming the part, and the server stays healthy and keeps answering; the same image
sent twice is one encoder-cache miss and one hit in ``/metrics``.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import transformers
from PIL import Image

from model_shards.launch.replicas import free_port
from tests.live_server import LiveServer, live_server
from tests.vlm import llava_checkpoint as ckpt

pytestmark = pytest.mark.timeout(240)

NEW = 8
QUESTION = "what is in the picture"


class _Handler(http.server.BaseHTTPRequestHandler):
    """``/good.png`` (image/png), ``/page.html`` (text/html), ``/slow.png`` (answers after
    3 s), anything else 404."""

    png = b""

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path in ("/good.png", "/slow.png"):
            self._send(200, "image/png", self.png)
        elif self.path == "/page.html":
            self._send(200, "text/html", b"<html>not an image</html>")
        else:
            self._send(404, "text/plain", b"missing")

    def _send(self, status: int, mime: str, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", mime)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (the timeout case)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ckpt.build(tmp_path_factory.mktemp("llava-serve") / "llava")


@pytest.fixture(scope="module")
def png() -> bytes:
    return ckpt.encoded(ckpt.image(11, (45, 40)))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory, png: bytes) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "good.png").write_bytes(png)
    (root / "allowed" / "picture.bmp").write_bytes(ckpt.encoded(ckpt.image(1), "BMP"))
    (root / "allowed" / "huge.png").write_bytes(b"\0" * (21 * 2**20))  # past the 20 MiB cap
    (root / "secret.png").write_bytes(png)
    (root / "allowed" / "link.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def http_url(png: bytes) -> Iterator[str]:
    _Handler.png = png
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def served(
    model_dir: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    args = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--allowed-local-media-path",
        str(media_dir / "allowed"),
        "--allow-private-media-urls",  # the origin is on 127.0.0.1
        "--media-fetch-timeout",
        "1",
        "--limit-mm-per-prompt",
        '{"image": 2}',
    ]
    with live_server(args, tmp_path_factory.mktemp("llava-log")) as server:
        yield server


@pytest.fixture(scope="module")
def expected(model_dir: Path, png: bytes) -> tuple[str, int]:
    """transformers' answer to ``[image, QUESTION]``: its text and the prompt's tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": f"{ckpt.IMAGE_TOKEN}\n{QUESTION}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    image_at = ids.index(ckpt.IMAGE_TOKEN_ID)
    ids[image_at : image_at + 1] = [ckpt.IMAGE_TOKEN_ID] * ckpt.TOKENS_PER_IMAGE
    img = Image.open(io.BytesIO(png))
    pixels = ckpt.hf_pixels(model_dir, img)[None]
    tokens = ckpt.hf_generate(model_dir, ids, pixels, NEW)
    return tokenizer.decode(tokens, skip_special_tokens=True), len(ids)


def _content(url: str) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chat(server: LiveServer, content: list[dict[str, Any]]) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_openai_sdk_sends_a_base64_image(
    served: LiveServer, png: bytes, expected: tuple[str, int]
) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": _content(_data_url(png))}],  # type: ignore[misc,list-item]
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == expected[0]
    assert reply.usage is not None and reply.usage.prompt_tokens == expected[1]


def test_file_and_http_urls_give_the_same_answer(
    served: LiveServer, media_dir: Path, http_url: str, expected: tuple[str, int]
) -> None:
    for url in (f"file://{media_dir}/allowed/good.png", f"{http_url}/good.png"):
        response = _chat(served, _content(url))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected[0]


def test_models_lists_the_image_modality(served: LiveServer) -> None:
    card = httpx.get(f"{served.url}/v1/models").json()["data"][0]
    assert card["modalities"] == ["text", "image"]


def _bad_inputs(
    png: bytes, media_dir: Path, http_url: str
) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """Twenty-five kinds of bad media: the content of one user message, and a fragment of
    the error message that says what is wrong."""
    closed = f"http://127.0.0.1:{free_port()}/x.png"
    gif = ckpt.encoded(ckpt.image(1), "GIF")
    jpeg = ckpt.encoded(ckpt.image(1), "JPEG")
    huge = ckpt.encoded(Image.new("1", (10_000, 10_000)))
    tall = ckpt.encoded(Image.new("1", (1, 100_000)))
    allowed = media_dir / "allowed"
    outside = "outside --allowed-local-media-path"
    not_image = "not a PNG, JPEG or WebP image"
    return {
        "truncated png": (_content(_data_url(png[: len(png) // 2])), "cannot be decoded"),
        "zero-byte data": (_content("data:image/png;base64,"), "empty"),
        "10k x 10k pixels": (_content(_data_url(huge)), "more than 40000000 pixels"),
        "1 x 100k pixels, resized past the cap": (_content(_data_url(tall)), "resizes it to"),
        "path outside the allowed dir": (_content(f"file://{media_dir}/secret.png"), outside),
        "link out of the allowed dir": (_content(f"file://{allowed}/link.png"), outside),
        "dot-dot out of the allowed dir": (_content(f"file://{allowed}/../secret.png"), outside),
        "missing local file": (_content(f"file://{allowed}/nope.png"), "no such file"),
        "file past the size cap": (_content(f"file://{allowed}/huge.png"), "larger than"),
        "unsupported codec (BMP)": (_content(f"file://{allowed}/picture.bmp"), not_image),
        "unreachable URL": (_content(closed), "could not fetch the image URL"),
        "HTTP 404": (_content(f"{http_url}/missing.png"), "could not fetch the image URL"),
        "URL serving HTML": (_content(f"{http_url}/page.html"), "could not fetch the image URL"),
        "fetch timeout": (_content(f"{http_url}/slow.png"), "could not fetch the image URL"),
        "GIF MIME type": (_content(_data_url(gif, "image/gif")), "MIME type 'image/gif'"),
        "text MIME type": (_content(_data_url(b"hello", "text/plain")), "MIME type 'text/plain'"),
        "declared PNG, JPEG inside": (_content(_data_url(jpeg)), "the data is a JPEG"),
        "GIF bytes declared PNG": (_content(_data_url(gif)), not_image),
        "not base64": (_content("data:image/png;base64,@@@not base64@@@"), "base64"),
        "unsupported scheme": (_content("ftp://example.com/x.png"), "data:, file: or http(s)"),
        "part without a URL": ([{"type": "image_url", "image_url": {}}], "needs a 'url'"),
        "three images, limit two": (
            _content(_data_url(png)) * 2 + _content(_data_url(png))[:1],
            "at most 2 per prompt",
        ),
        "video to a model without video": (
            [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}],
            "does not take videos",
        ),
        "video part without a URL": ([{"type": "video_url", "video_url": {}}], "needs a 'url'"),
        "text holding the image token": (
            [*_content(_data_url(png))[:1], {"type": "text", "text": f"{ckpt.IMAGE_TOKEN} x"}],
            "holds the image token",
        ),
    }


def test_bad_media_is_a_400_naming_the_part(
    served: LiveServer, png: bytes, media_dir: Path, http_url: str, expected: tuple[str, int]
) -> None:
    for kind, (content, says) in _bad_inputs(png, media_dir, http_url).items():
        response = _chat(served, content)
        assert response.status_code == 400, f"{kind}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", kind
        assert says in error["message"], f"{kind}: {error}"
        assert str(error["param"]).startswith("messages"), f"{kind}: {error}"
        if kind not in ("three images, limit two", "text holding the image token"):
            assert "content[0]" in error["message"], f"{kind}: the part is named: {error}"
        assert httpx.get(f"{served.url}/health").status_code == 200, kind
    good = _chat(served, _content(_data_url(png)))  # and it still answers correctly
    assert good.status_code == 200
    assert good.json()["choices"][0]["message"]["content"] == expected[0]


def _mm_cache(server: LiveServer) -> tuple[float, float]:
    """``/metrics``' encoder-cache (hits, misses) totals."""
    found = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        for kind in ("hits", "misses"):
            if line.startswith(f"shardserve_mm_encoder_cache_{kind}_total "):
                found[kind] = float(line.split()[1])
    return found["hits"], found["misses"]


def test_the_same_image_twice_is_an_encoder_cache_hit(served: LiveServer) -> None:
    url = _data_url(ckpt.encoded(ckpt.image(5, (30, 30))))  # an image no other test sends
    hits, misses = _mm_cache(served)
    for text in ("first", "second"):  # text before the image: no prefix-cache hit on it
        content = [{"type": "text", "text": text}, *_content(url)]
        assert _chat(served, content).status_code == 200
    assert _mm_cache(served) == (hits + 1, misses + 1)
