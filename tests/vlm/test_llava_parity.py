"""LLaVA against ``transformers`` on a tiny random checkpoint (:mod:`tests.vlm.llava_checkpoint`):
the frontend's preprocessing equals the checkpoint's ``CLIPImageProcessor`` bit for bit, and
greedy tokens equal ``generate()`` with the same images at tp=1 (in process), tp=2 and pp=2
(spawned worlds): two different images in one batch, an image inside a long text prompt
prefilled in 16-token chunks (the image's placeholder run split across steps). At tp=1
also: the same image twice is served from the caches (prefix-cache hit tokens covering
the image; with another text before it, an encoder-cache hit and no second encoding),
and a new image after a cached one shares no KV block holding image positions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, MediaInput, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from server.media.image import ClipPreprocessor
from tests.vlm import llava_checkpoint as ckpt
from tests.world import run_world

NEW = 10
MAX_LEN = 256
IMG = [ckpt.IMAGE_TOKEN_ID] * ckpt.TOKENS_PER_IMAGE
# (name, text before the image, text after it, image seed); "long" is prefilled in chunks
PROMPTS = {
    "a": ([0, 5, 6], [7, 8, 9], 1),
    "b": ([0, 5, 6], [7, 8, 9], 2),
    "a_other_text": ([0, 44, 45, 46, 47, 48, 49], [12], 1),
    "c": ([0, 5, 6], [7, 8, 9], 3),
    "long": ([0, *range(100, 160)], list(range(200, 260)), 4),
}


def _image(seed: int) -> object:
    return ckpt.image(seed, size=(41 + seed, 37))


def _request(rid: str, model_dir: Path, max_tokens: int = NEW) -> GenerateRequest:
    before, after, seed = PROMPTS[rid]
    pre = ClipPreprocessor.from_file(model_dir / "preprocessor_config.json")
    pixels = pre(_image(seed))  # type: ignore[arg-type]
    media = MediaInput(
        len(before),
        len(IMG),
        hashlib.sha256(pixels.tobytes()).digest(),
        pixels.tobytes(),
        list(pixels.shape),
    )
    return GenerateRequest(
        rid,
        [*before, *IMG, *after],
        max_tokens,
        SamplingParams(0.0),
        ignore_eos=True,
        media=[media],
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ckpt.build(tmp_path_factory.mktemp("llava") / "llava")


@pytest.fixture(scope="module")
def references(model_dir: Path) -> dict[str, list[int]]:
    out = {}
    for rid, (before, after, seed) in PROMPTS.items():
        pixels = ckpt.hf_pixels(model_dir, _image(seed))  # type: ignore[arg-type]
        out[rid] = ckpt.hf_generate(model_dir, [*before, *IMG, *after], pixels[None], NEW)
    return out


def _coordinator(peers: Comm, model_dir: Path, chunk: int) -> tuple[Worker, Coordinator]:
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=8, block_size=4)
    worker = Worker.build(replica, cfg, peers, MAX_LEN)
    coord = Coordinator(worker, max_num_seqs=8, max_num_batched_tokens=chunk, max_model_len=MAX_LEN)
    return worker, coord


def _run(coord: Coordinator, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    for r in requests:
        coord.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while coord.has_work():
        for update in coord.step():
            out[update.output.request_id] += update.output.new_token_ids
    coord.step()  # flush frees
    return out


def test_preprocessing_matches_transformers(model_dir: Path) -> None:
    pre = ClipPreprocessor.from_file(model_dir / "preprocessor_config.json")
    images = [
        ckpt.image(1, (41, 37)),
        ckpt.image(2, (20, 90)),  # tall: the short side is the width
        ckpt.image(3, (64, 64), "RGBA"),  # alpha over white
        ckpt.image(4, (50, 33), "L"),  # grayscale
    ]
    for img in images:
        ours = pre(img)
        ref = ckpt.hf_pixels(model_dir, img).numpy()
        assert ours.shape == ref.shape == (3, 30, 30)
        assert np.array_equal(ours, ref), f"{img.mode} {img.size}"


@pytest.mark.timeout(120)
def test_tp1_matches_transformers_and_reuses_caches(
    model_dir: Path, references: dict[str, list[int]]
) -> None:
    worker, coord = _coordinator(Comm(single_process_state()), model_dir, chunk=16)
    assert worker.media is not None
    stats = worker.media.stats
    # two different images with the same text, in one batch
    out = _run(coord, [_request("a", model_dir), _request("b", model_dir)])
    assert out == {"a": references["a"], "b": references["b"]}
    assert out["a"] != out["b"]
    assert stats.misses == 2  # each encoded once, its later chunks served from the cache
    # the same image and text again: its KV blocks (image included) come from the cache
    hits = coord.stats.prefix_cache_hit_tokens
    assert _run(coord, [_request("a", model_dir)])["a"] == references["a"]
    assert coord.stats.prefix_cache_hit_tokens - hits >= 3 + len(IMG) - 4
    # the same image after other text: no shared block, but the encoder output is reused
    misses, cached = stats.misses, stats.hits
    again = _run(coord, [_request("a_other_text", model_dir)])
    assert again["a_other_text"] == references["a_other_text"]
    assert stats.misses == misses and stats.hits > cached
    # a new image after the same text: only the blocks before the image are shared
    hits = coord.stats.prefix_cache_hit_tokens
    assert _run(coord, [_request("c", model_dir)])["c"] == references["c"]
    assert coord.stats.prefix_cache_hit_tokens - hits <= 3
    assert stats.misses == misses + 1
    # a long prompt in 16-token chunks: the image's 25 placeholders span two or three steps
    assert _run(coord, [_request("long", model_dir)])["long"] == references["long"]
    coord.shutdown()


def test_llava_hf_tensor_names_load(
    model_dir: Path, tmp_path: Path, references: dict[str, list[int]]
) -> None:
    """llava-hf's checkpoints name the tower ``vision_tower.vision_model.*``: the same
    weights under those names give the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "llava-hf"
    shutil.copytree(model_dir, renamed)
    tensors = load_file(renamed / "model.safetensors")
    prefix = "vision_tower."
    tensors = {
        (k.replace(prefix, prefix + "vision_model.", 1) if k.startswith(prefix) else k): v
        for k, v in tensors.items()
    }
    assert any(k.startswith("vision_tower.vision_model.") for k in tensors)
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    _worker, coord = _coordinator(Comm(single_process_state()), renamed, chunk=64)
    assert _run(coord, [_request("a", renamed)])["a"] == references["a"]
    coord.shutdown()


def _world_rank(peers: Comm, model_dir: str, out_dir: str) -> None:
    worker, coord = _coordinator(peers, Path(model_dir), chunk=16)
    if peers.ps.rank != 0:
        worker.serve_forever()
        return
    requests = [_request(r, Path(model_dir)) for r in ("a", "b", "long")]
    result = _run(coord, requests)
    Path(out_dir, "tokens.json").write_text(json.dumps(result))
    coord.shutdown()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_layouts_match_transformers(
    tp: int, pp: int, tmp_path: Path, model_dir: Path, references: dict[str, list[int]]
) -> None:
    run_world(_world_rank, tp, pp, str(model_dir), str(tmp_path), timeout=180)
    result = json.loads((tmp_path / "tokens.json").read_text())
    assert result == {r: references[r] for r in ("a", "b", "long")}


def test_vision_tower_is_sharded(model_dir: Path) -> None:
    """At tp=2 each rank holds half of every vision projection (a smoke check of the
    layer choice; the numbers are checked by the tp2 parity test)."""
    from model_shards.backends import select_backend
    from model_shards.config.vlm import llava_config
    from model_shards.layers.context import ShardContext
    from model_shards.models.clip_vision import ClipVisionTower

    llava = llava_config(json.loads((model_dir / "config.json").read_text()))
    ctx = ShardContext.single_process(select_backend(torch.device("cpu"), torch.float32))
    tower = ClipVisionTower(llava.vision, ctx, llava.layers_run)
    assert len(tower.encoder.layers) == 2  # vision_feature_layer -2 of 3 layers
