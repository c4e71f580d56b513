"""Multi-LoRA parity: the base model and two adapters mixed in one batch give transformers +
peft's greedy tokens, at tp=1 and tp=2.

Adapter ``a1`` targets all seven Llama modules (r=8), ``a2`` q/v/down with rslora (r=4): the
tp=2 world splits B along column-parallel outputs (q/k/v: by head, GQA) and A along
row-parallel inputs (o, down); at pp=2 each stage fills only its own layers' slots. Every
request is queued before the first step, so the rows of base, ``a1`` and ``a2`` run in the same
steps, from two slots (``--max-loras 2``). At tp=1 decode steps replay (fake) decode graphs
whose inputs include each row's slot, as CUDA graphs do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_shards.backends.reference import ReferenceBackend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, LoraRef, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import build_tiny_llama
from tests.lora_adapters import peft_greedy, write_adapter
from tests.model_shards.backends.cuda.fake_graphs import FakeGraphBackend
from tests.raw_adapters import write_raw_adapter
from tests.world import run_world

PROMPTS = [[3, 17, 250, 96, 42, 7, 51, 64, 100], [5, 6, 900, 31]]
NEW_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (request id, prompt index, adapter name or None)
CASES = [("0", 0, None), ("1", 0, "a1"), ("2", 1, "a2"), ("3", 1, "a1"), ("4", 1, None)]
CASES += [("5", 0, "a2")]


class _FakeGraphed(ReferenceBackend):
    """The reference ops with decode steps through (fake) graphs: slot ids as graph inputs."""

    fake = FakeGraphBackend()

    def graph_backend(self) -> FakeGraphBackend:  # type: ignore[override]
        return self.fake


def _rank(peers: Comm, base: str, adapters: dict[str, str], out: str, graphs: bool) -> None:
    replica = ReplicaConfig(
        base, dtype="float32", max_num_seqs=8, block_size=4, enable_lora=True, max_loras=2,
        max_lora_rank=8,
    )  # fmt: skip
    ops = _FakeGraphed() if graphs else None
    worker = Worker.build(replica, ModelConfig.from_dir(base), peers, 128, ops)
    assert (worker.graphs is not None) == graphs
    if peers.ps.rank != 0:
        worker.serve_forever()
        return
    limits = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 128}
    coord = Coordinator(worker, **limits, pipeline_overlap=False)  # pp=2: one batch of all
    refs = {name: LoraRef(i + 1, name, path) for i, (name, path) in enumerate(adapters.items())}
    bad = GenerateRequest("bad", [1, 2], 2, lora=LoraRef(9, "big", refs.pop("big").path))
    with pytest.raises(ValueError, match="rank r=16 is above --max-lora-rank 8"):
        coord.add_request(bad)  # refused by rank 0, before any rank reads it
    for rid, p, name in CASES:
        lora = None if name is None else refs[name]
        params = SamplingParams(0.0)
        coord.add_request(
            GenerateRequest(rid, PROMPTS[p], NEW_TOKENS, params, ignore_eos=True, lora=lora)
        )
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in CASES}
    widths = []
    while coord.has_work():
        for update in coord.step():
            tokens[update.output.request_id] += update.output.new_token_ids
        widths.append(coord.stats.num_running)
    coord.step()
    assert coord.stats.num_free_blocks == coord.stats.num_blocks
    assert not graphs or _FakeGraphed.fake.replays > 0  # decode steps took the graphs
    Path(out, "tokens.json").write_text(json.dumps({"tokens": tokens, "widths": widths}))
    coord.shutdown()


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(root / "base", sharded=False)
    adapters = {
        "a1": write_adapter(base, root / "a1", ALL, r=8, alpha=16, seed=1),
        "a2": write_adapter(base, root / "a2", ["q_proj", "v_proj", "down_proj"], r=4, alpha=8,
                            rslora=True, seed=2),
    }  # fmt: skip
    expected = {
        rid: peft_greedy(base, None if a is None else adapters[a], PROMPTS[p], NEW_TOKENS)
        for rid, p, a in CASES
    }
    adapters["big"] = write_raw_adapter(root / "big", r=16)  # the tiny shapes, rank 16
    return base, {k: str(v) for k, v in adapters.items()}, expected


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("tp", "pp", "graphs"), [(1, 1, True), (2, 1, False), (1, 2, False)])
def test_mixed_adapters_match_peft(
    tp: int, pp: int, graphs: bool, tmp_path: Path, lora_case: tuple
) -> None:
    base, adapters, expected = lora_case
    # the adapters change the outputs (else this test could not fail)
    assert expected["1"] != expected["0"] and expected["5"] != expected["0"]
    assert expected["2"] != expected["4"] != expected["3"]
    run_world(_rank, tp, pp, str(base), adapters, str(tmp_path), graphs, timeout=150)
    result = json.loads(Path(tmp_path, "tokens.json").read_text())
    assert result["tokens"] == expected
    assert max(result["widths"]) == len(CASES)  # all ran in the same steps
