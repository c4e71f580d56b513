"""The cpu backend's whole-step decode (``models/plain_decode.py``,
``backends/cpu/kernels/decode_stack.cpp``) against the modules it replaces: the same greedy
tokens and the same logits bit for bit, on every kind of linear layer it takes (GGUF
K-quants and 32-value types mixed within one projection, on-the-fly Q8_0 with q/k/v biases,
dense packed bfloat16 with biases) and Qwen3's per-head q/k norms, several sequences a step
across KV blocks; and the layers it must leave to the modules (Gemma 2's soft-caps and
sandwich norms) left to them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model_shards.backends.cpu.decode_stack import ENV_VAR
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import build_tiny_qwen2
from tests.model_shards.gguf import tiny
from tests.model_shards.models.parity_harness import generate_greedy

PROMPTS = [[5, 17, 42, 7, 99, 3, 12], [8, 1, 250, 33] * 4, [61, 2]]
NEW_TOKENS = 20  # past a 16-token block in every sequence


def _serve(
    model: Path, quantization: str | None, whole_step: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, list[int]], list[torch.Tensor], bool]:
    """Greedy tokens of :data:`PROMPTS` served at once on the cpu backend, every step's
    logits, and whether decode steps ran through the whole-step decode."""
    monkeypatch.setenv("SHARDSERVE_BACKEND", "cpu")
    monkeypatch.setenv(ENV_VAR, "1" if whole_step else "0")
    cfg = ModelConfig.from_dir(str(model))
    replica = ReplicaConfig(
        str(model), dtype="bfloat16", quantization=quantization, max_num_seqs=4, block_size=16
    )
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 64)
    assert worker.ops.name == "cpu"
    logits: list[torch.Tensor] = []
    compute: Callable[[torch.Tensor], torch.Tensor] = worker.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out.clone())
        return out

    worker.model.compute_logits = recorded  # type: ignore[method-assign]
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    tokens = generate_greedy(coord, PROMPTS, NEW_TOKENS)
    active = worker.model.model.plain_decode.active  # type: ignore[attr-defined]
    coord.shutdown()
    return tokens, logits, active


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plain-decode")
    return {
        "llama-gguf": tiny.build("llama", root),
        "qwen3-gguf": tiny.build("qwen3", root),
        "gemma2-gguf": tiny.build("gemma2", root),
        "qwen2": build_tiny_qwen2(root / "qwen2"),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "quantization"),
    [("llama-gguf", None), ("qwen2", "q8_0"), ("qwen2", None), ("qwen3-gguf", None)],
    ids=["gguf-k-quants-mixed", "q8_0-biases", "bf16-packed-biases", "qk-norms"],
)
def test_whole_step_decode_has_the_modules_bits(
    checkpoints: dict[str, Path],
    name: str,
    quantization: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens, logits, active = _serve(checkpoints[name], quantization, True, monkeypatch)
    want_tokens, want_logits, modules_active = _serve(
        checkpoints[name], quantization, False, monkeypatch
    )
    assert active and not modules_active
    assert tokens == want_tokens
    assert len(logits) == len(want_logits) == 1 + NEW_TOKENS - 1  # a prefill, then decodes
    for step, (ours, want) in enumerate(zip(logits, want_logits, strict=True)):
        assert torch.equal(ours, want), f"step {step}"


@pytest.mark.timeout(120)
def test_soft_capped_layers_stay_with_the_modules(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, _, active = _serve(checkpoints["gemma2-gguf"], None, True, monkeypatch)
    assert not active
    assert all(len(t) == NEW_TOKENS for t in tokens.values())
