"""Fixtures: a tiny byte-level BPE checkpoint, a fake engine, and a live server on a free port."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from server.engine.client import EngineClient
from server.http.app import build_app
from server.text.tokenizer import Tokenizer
from tests.server.fake_engine import FakeEngine
from tests.waiting import async_wait_until

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? 你好，世界。日本語のテキスト 😀🎉🚀 emoji and CJK text",
    "one two three four five six seven eight nine ten STOP here END",
]
SPECIALS = ["<s>", "</s>", "<unk>"]
BOS_ID, EOS_ID = 0, 1
API_KEY = "sk-test-key"

#: A Zephyr/Llama-style template: BOS, an optional system message (else a default),
#: a loop with a role check, EOS after each turn, and the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = 'You are a helpful assistant.' %}"
    "{% set loop_messages = messages %}{% endif %}\n"
    "<|system|>\n{{ system | trim }}{{ eos_token }}\n"
    "{% for message in loop_messages %}\n"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}\n"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tiny_tokenizer(
    directory: Path, *, bos_post_processor: bool = True, chat_template: str | None = CHAT_TEMPLATE
) -> Path:
    """A byte-level BPE (specials <s>=0, </s>=1) saved as tokenizer.json + tokenizer_config.json
    (with ``chat_template`` unless it is ``None``)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": bos_post_processor,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_tiny_model_config(directory: Path, vocab_size: int) -> None:
    """A config.json that ``ModelConfig`` accepts (4 heads, 2 layers): enough for the CLI."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture
def ipc_address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/engine.sock"


@pytest.fixture
def make_engine(ipc_address: str, tokenizer: Tokenizer) -> Iterator[Callable[..., FakeEngine]]:
    """``make_engine(engine_class=FakeEngine, **its kwargs)``: a started fake engine (or a
    subclass), stopped at teardown."""
    engines: list[FakeEngine] = []

    def make(engine_class: type[FakeEngine] = FakeEngine, **kwargs: Any) -> FakeEngine:
        options: dict[str, Any] = {
            "vocab_size": tokenizer.vocab_size,
            "eos_token_ids": [EOS_ID],
            "special_ids": {BOS_ID},
        }
        options.update(kwargs)
        engine = engine_class(ipc_address, **options).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


@dataclass
class Served:
    """A live server: ``http`` talks to it, ``engine`` is the fake behind it."""

    http: httpx.AsyncClient
    engine: FakeEngine
    client: EngineClient
    base_url: str


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


ServeFactory = Callable[..., Any]


@pytest.fixture
async def serve(
    make_engine: Callable[..., FakeEngine], tokenizer: Tokenizer
) -> AsyncIterator[ServeFactory]:
    """``await serve(**engine_kwargs, batch_window_s=..., wait_ready=True, api_key=...,
    max_request_bytes=..., served_tokenizer=...)`` → :class:`Served`."""
    cleanups: list[Callable[[], Any]] = []

    async def start(
        *,
        batch_window_s: float = 0.002,
        wait_ready: bool = True,
        max_model_len: int = 256,
        api_key: str | None = None,
        max_request_bytes: int | None = None,
        served_tokenizer: Tokenizer | None = None,
        app_options: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> Served:
        engine = make_engine(max_model_len=max_model_len, **engine_kwargs)
        client = EngineClient(
            engine.address,
            is_alive=engine.is_alive,
            batch_window_s=batch_window_s,
            liveness_interval_s=0.05,
        )
        connecting = asyncio.ensure_future(client.connect(timeout_s=30))
        if wait_ready:
            await connecting
        options: dict[str, Any] = {"api_key": api_key, **(app_options or {})}
        if max_request_bytes is not None:
            options["max_request_bytes"] = max_request_bytes
        app = build_app(client, served_tokenizer or tokenizer, "tiny", max_model_len, **options)
        sock = free_socket()
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        await async_wait_until(lambda: server.started, "uvicorn to start serving", timeout=30)
        base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        http = httpx.AsyncClient(base_url=base_url, timeout=30)

        async def cleanup() -> None:
            await http.aclose()
            server.should_exit = True
            await task
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            await client.close()
            sock.close()

        cleanups.append(cleanup)
        return Served(http, engine, client, base_url)

    yield start
    for cleanup in reversed(cleanups):
        await cleanup()
