"""The mixture-of-experts families beyond the layouts of ``test_family_parity.py`` (which
runs them at tp=1, tp=2 and pp=2): tp=2 with expert parallelism against ``transformers``
(prompt logits in float32 to 1e-4 relative, 24 greedy tokens identical; each rank holding
E / 2 whole experts), in one spawned world; the per-expert token counts against the
experts ``transformers``' routers pick; DeepSeek-V2's KV pool holding only the latent;
and the layouts refused before spawning.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.layers.moe import SparseMoeBlock, expert_token_counts
from model_shards.messages import GenerateRequest, SamplingParams, StepOutputs
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import hf_greedy, hf_prompt_logits, load_hf_model
from tests.families import deepseek_v2, mixtral, qwen2_moe, qwen3_moe
from tests.logits import load_rows
from tests.model_shards.models.parity_harness import MAX_LEN, NEW_TOKENS, PROMPTS, serve_and_record
from tests.server.cli.spawn_guard import Spawned, error_line, run_cli
from tests.world import run_world

MOE_FAMILIES: list[ModuleType] = [mixtral, qwen2_moe, qwen3_moe, deepseek_v2]


def _check_experts_held(worker: Worker, num_experts: int) -> None:
    """Every sparse layer of this rank holds experts ``r E/tp .. (r+1) E/tp - 1`` whole."""
    ps = worker.ps
    blocks = [m for m in worker.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks, "no sparse layer built"
    per_rank = num_experts // ps.tp_size
    for block in blocks:
        experts = block.experts
        assert experts.first_expert == ps.tp_rank * per_rank
        assert experts.w13_weight.shape[0] == per_rank
        assert experts.w2_weight.shape[1:] == (block.gate.weight.shape[1], experts.i_local)


def _ep_rank(peers: Comm, dirs: dict[str, str], experts: dict[str, int], out_dir: str) -> None:
    for name, model_dir in dirs.items():
        cfg = ModelConfig.from_dir(model_dir)
        replica = ReplicaConfig(
            model_dir, dtype="float32", max_num_seqs=8, block_size=4, enable_expert_parallel=True
        )
        worker = Worker.build(replica, cfg, peers, MAX_LEN)
        _check_experts_held(worker, experts[name])
        serve_and_record(worker, name, out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f.NAME: f.build(root / f.NAME) for f in MOE_FAMILIES}


@pytest.mark.timeout(300)
def test_expert_parallel_matches_transformers(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    dirs = {name: str(path) for name, path in checkpoints.items()}
    experts = {f.NAME: f.NUM_EXPERTS for f in MOE_FAMILIES}
    run_world(_ep_rank, 2, 1, dirs, experts, str(tmp_path), timeout=240)
    for name, path in checkpoints.items():
        result = json.loads((tmp_path / f"{name}.json").read_text())
        ours = load_rows(tmp_path / f"{name}-logits.safetensors", result["seqs"])
        for i, prompt in enumerate(PROMPTS):
            ref = hf_prompt_logits(path, prompt)[-1]
            rel = ((ours[i] - ref).abs().max() / ref.abs().max()).item()
            assert rel < 1e-4, f"{name} prompt {i}: logits relative error {rel:.2e}"
            assert result["tokens"][str(i)] == hf_greedy(path, prompt, NEW_TOKENS), f"{name} {i}"


def _hf_expert_counts(
    path: Path, prompt: list[int], num_experts: int, top_k: int
) -> list[list[int]]:
    """Per sparse layer, how many of the prompt's tokens transformers routes to each expert."""
    model = load_hf_model(path)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_router_logits=True)
    return [
        torch.bincount(
            logits.topk(top_k, dim=-1).indices.reshape(-1), minlength=num_experts
        ).tolist()
        for logits in out.router_logits
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", [mixtral, qwen2_moe], ids=lambda f: f.NAME)
def test_expert_token_counts_are_the_routers_choices(
    family: ModuleType, checkpoints: dict[str, Path]
) -> None:
    path = checkpoints[family.NAME]
    cfg = ModelConfig.from_dir(path)
    replica = ReplicaConfig(str(path), dtype="float32", block_size=4)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), MAX_LEN)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN)
    prompt = list(range(30, 71))
    coord.add_request(GenerateRequest("r", prompt, 1, SamplingParams(0.0)))
    sampled = []
    while coord.has_work():
        for _, reply in coord.work():
            assert isinstance(reply, StepOutputs) and reply.stats is not None
            sampled.append(reply.stats.moe_expert_tokens)
    counts = expert_token_counts(worker.model)
    assert sampled == [counts], "the one step's stats carry the counts after it"
    sparse = [i for i in range(cfg.num_layers) if i not in cfg.extra.get("mlp_only_layers", [])]
    assert sorted(counts) == sparse
    expected = _hf_expert_counts(path, prompt, family.NUM_EXPERTS, 2)
    assert [counts[i] for i in sparse] == expected
    assert all(sum(c) == 2 * len(prompt) for c in counts.values())


def _serve(model: Path, *flags: str) -> list[str]:
    return ["serve", "--port", "0", "--device", "cpu", "--model", str(model), *flags]


@pytest.mark.timeout(60)
def test_expert_layouts_refused_before_spawning(
    checkpoints: dict[str, Path], no_spawning: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """6 experts over 4 ranks, a 42-wide expert over 4 slices and experts asked of a dense
    model are each exit 2 naming the flag (and the sizes that fit); the fitting layouts
    reach spawning."""
    qwen2, qwen3 = checkpoints["qwen2_moe"], checkpoints["qwen3_moe"]
    assert run_cli(_serve(qwen2, "-tp", "4", "--enable-expert-parallel")) == 2
    line = error_line(capsys.readouterr().err)
    assert "--enable-expert-parallel" in line and "6 experts are not divisible by 4" in line
    assert "valid sizes with expert parallelism: [1, 2]" in line
    assert run_cli(_serve(qwen3, "-tp", "4")) == 2
    line = error_line(capsys.readouterr().err)
    assert "--tensor-parallel-size 4" in line and "expert intermediate size 42" in line
    assert "valid sizes: [1, 2]" in line and "--enable-expert-parallel" in line
    dense = qwen3.parent / "dense"  # qwen3_moe's files, its config.json naming Llama
    dense.mkdir(exist_ok=True)
    for f in qwen3.iterdir():
        (dense / f.name).write_bytes(f.read_bytes())
    config = json.loads((dense / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (dense / "config.json").write_text(json.dumps(config))
    assert run_cli(_serve(dense, "--enable-expert-parallel")) == 2
    assert "has no experts" in error_line(capsys.readouterr().err)
    for model, flags in ((qwen3, ["-tp", "4", "--enable-expert-parallel"]), (qwen2, ["-tp", "2"])):
        with pytest.raises(Spawned):
            run_cli(_serve(model, *flags))


@pytest.mark.timeout(60)
def test_mla_pool_holds_only_the_latent(checkpoints: dict[str, Path]) -> None:
    """DeepSeek-V2's pool: one buffer per layer, ``kv_lora_rank + qk_rope_head_dim`` values
    per token (K and V the same tensor), not ``2 x heads x head_dim``; sized so."""
    path = checkpoints["deepseek_v2"]
    cfg = ModelConfig.from_dir(path)
    width = deepseek_v2.KV_LORA_RANK + deepseek_v2.QK_ROPE_HEAD_DIM
    replica = ReplicaConfig(str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 20)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), MAX_LEN)
    slots = worker.kv.num_blocks * 4
    for layer in range(cfg.num_layers):
        pool = worker.kv.pools[layer]
        assert pool.k.shape == (slots, 1, width)
        assert pool.v.data_ptr() == pool.k.data_ptr()
    per_block = cfg.kv_block_bytes(1, cfg.num_layers, 4, 4)
    assert per_block == cfg.num_layers * 4 * width * 4
    assert worker.kv.num_blocks == (1 << 20) // per_block
