"""Qwen2.5-VL against ``transformers`` on a tiny random checkpoint
(:mod:`tests.vlm.qwen2_5_vl_checkpoint`): greedy tokens equal ``generate()`` with the same
inputs at tp=1 (in process), tp=2 and pp=2 (spawned worlds, one per layout): two different
images in one batch, the same image again after other text (an encoder-cache hit, no
second encoding), a 4-frame video (``pixel_values_videos`` / ``video_grid_thw`` /
``second_per_grid_ts`` for transformers, the same arrays in the ``MediaInput``), an image
and a video in one prompt, and an image inside a long text prompt prefilled in 16-token
chunks (its placeholder run and M-RoPE positions split across steps). At tp=1 also: the
same request twice is a prefix-cache hit, and transformers 5.x's in-memory tensor names
(``model.language_model.*``, ``model.visual.*``) load to the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, MediaInput, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from server.media.qwen2_5_vl.image import QwenVLPreprocessor
from tests.vlm import llava_checkpoint
from tests.vlm import qwen2_5_vl_checkpoint as ckpt
from tests.world import run_world

NEW = 10
MAX_LEN = 256
# media specs: ("image", seed, (width, height)) / ("video", seed, frames, (H, W), seconds)
IMAGE_A = ("image", 1, (112, 84))  # 6 x 8 patches: 12 tokens, 2 x 2 windows
IMAGE_B = ("image", 2, (56, 112))  # 8 x 4 patches: 8 tokens
IMAGE_C = ("image", 3, (84, 70))  # smart_resize rounds it to whole merge windows
VIDEO = ("video", 5, 4, (56, 84), 1.0)  # 4 frames: 2 temporal patches of 4 x 6
PROMPTS: dict[str, tuple[list[int], list[tuple[Any, ...]], list[int]]] = {
    "a": ([0, 5, 6], [IMAGE_A], [7, 8, 9]),
    "b": ([0, 5, 6], [IMAGE_B], [7, 8, 9]),
    "a_other_text": ([0, 44, 45, 46, 47, 48, 49], [IMAGE_A], [12]),
    "video": ([0, 21, 22], [VIDEO], [23, 24]),
    "mixed": ([0, 31], [IMAGE_C, VIDEO], [32, 33]),
    "long": ([0, *range(100, 160)], [IMAGE_B], list(range(200, 260))),
}
WORLD_REQUESTS = ("a", "b", "video", "mixed", "long")


def _media(spec: tuple[Any, ...], model_dir: Path) -> dict[str, Any]:
    """One item's arrays, as transformers and the ``MediaInput`` both get them."""
    if spec[0] == "image":
        pre = QwenVLPreprocessor.from_file(model_dir / "preprocessor_config.json")
        image = pre(llava_checkpoint.image(spec[1], spec[2]))
        return {"kind": "image", "pixels": image.pixels, "grid": list(image.grid_thw)}
    _, seed, frames, size, seconds = spec
    pixels, grid = ckpt.video_patches(seed, frames, size)
    return {"kind": "video", "pixels": pixels, "grid": grid, "second_per_grid": seconds}


def _layout(rid: str, model_dir: Path) -> tuple[list[int], list[dict[str, Any]], list[int]]:
    """The prompt token ids (vision_start, pad x N, vision_end per item), items, offsets."""
    before, specs, after = PROMPTS[rid]
    ids, items, offsets = list(before), [], []
    for spec in specs:
        item = _media(spec, model_dir)
        t, h, w = item["grid"]
        pad = ckpt.IMAGE_PAD if item["kind"] == "image" else ckpt.VIDEO_PAD
        ids.append(ckpt.VISION_START)
        offsets.append(len(ids))
        ids += [pad] * (t * h * w // ckpt.MERGE**2)
        ids.append(ckpt.VISION_END)
        items.append(item)
    return ids + list(after), items, offsets


def _request(rid: str, model_dir: Path) -> GenerateRequest:
    ids, items, offsets = _layout(rid, model_dir)
    media = []
    for item, offset in zip(items, offsets, strict=True):
        pixels: np.ndarray = item["pixels"]
        grid = [int(g) for g in item["grid"]]
        digest = hashlib.sha256(pixels.tobytes() + bytes(str(grid), "ascii")).digest()
        length = grid[0] * grid[1] * grid[2] // ckpt.MERGE**2
        media.append(
            MediaInput(
                offset,
                length,
                digest,
                pixels.tobytes(),
                list(pixels.shape),
                kind=item["kind"],
                grid_thw=grid,
                second_per_grid=float(item.get("second_per_grid", 0.0)),
            )
        )
    return GenerateRequest(rid, ids, NEW, SamplingParams(0.0), ignore_eos=True, media=media)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ckpt.build(tmp_path_factory.mktemp("qwen2_5_vl") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def references(model_dir: Path) -> dict[str, list[int]]:
    out = {}
    for rid in PROMPTS:
        ids, items, _ = _layout(rid, model_dir)
        out[rid] = ckpt.hf_generate(model_dir, ids, items, NEW)
    return out


def _coordinator(peers: Comm, model_dir: Path, chunk: int = 16) -> tuple[Worker, Coordinator]:
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


def test_layouts_are_what_the_test_means(model_dir: Path) -> None:
    """The prompts exercise what the module docstring says (grids, chunk-split runs)."""
    ids, items, offsets = _layout("a", model_dir)
    assert items[0]["grid"] == [1, 6, 8] and ids.count(ckpt.IMAGE_PAD) == 12
    assert _layout("video", model_dir)[1][0]["grid"] == [2, 4, 6]
    ids, _, offsets = _layout("long", model_dir)
    assert offsets[0] // 16 != (offsets[0] + 8) // 16  # the image's run crosses a chunk edge


@pytest.mark.timeout(120)
def test_tp1_matches_transformers_and_reuses_caches(
    model_dir: Path, references: dict[str, list[int]]
) -> None:
    worker, coord = _coordinator(Comm(single_process_state()), model_dir)
    assert worker.media is not None
    stats = worker.media.stats
    out = _run(coord, [_request("a", model_dir), _request("b", model_dir)])
    assert out == {"a": references["a"], "b": references["b"]}
    assert out["a"] != out["b"]
    assert stats.misses == 2
    # the same request again: its KV blocks (image included) come from the prefix cache
    hits = coord.stats.prefix_cache_hit_tokens
    assert _run(coord, [_request("a", model_dir)])["a"] == references["a"]
    assert coord.stats.prefix_cache_hit_tokens - hits >= 16
    # the same image after other text: no shared block, the encoder output reused
    misses, cached = stats.misses, stats.hits
    assert _run(coord, [_request("a_other_text", model_dir)]) == {
        "a_other_text": references["a_other_text"]
    }
    assert stats.misses == misses and stats.hits > cached
    for rid in ("video", "mixed", "long"):
        assert _run(coord, [_request(rid, model_dir)]) == {rid: references[rid]}, rid
    coord.shutdown()


def test_transformers_5_in_memory_names_load(
    model_dir: Path, tmp_path: Path, references: dict[str, list[int]]
) -> None:
    """``model.language_model.*`` / ``model.visual.*`` (and an explicit tied
    ``lm_head.weight``) give the same tokens."""
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    shutil.copytree(model_dir, renamed)
    tensors = load_file(renamed / "model.safetensors")
    assert "visual.merger.ln_q.weight" in tensors and "model.norm.weight" in tensors

    def new_name(k: str) -> str:
        return (
            "model." + k
            if k.startswith("visual.")
            else k.replace("model.", "model.language_model.", 1)
        )

    tensors = {new_name(k): v for k, v in tensors.items()}
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    _worker, coord = _coordinator(Comm(single_process_state()), renamed, chunk=64)
    assert _run(coord, [_request("video", renamed)])["video"] == references["video"]
    coord.shutdown()


def _world_rank(peers: Comm, model_dir: str, out_dir: str) -> None:
    worker, coord = _coordinator(peers, Path(model_dir))
    if peers.ps.rank != 0:
        worker.serve_forever()
        return
    assert worker.media is not None
    result = _run(coord, [_request(r, Path(model_dir)) for r in WORLD_REQUESTS])
    misses, hits = worker.media.stats.misses, worker.media.stats.hits
    result |= _run(coord, [_request("a_other_text", Path(model_dir))])
    reuse = [worker.media.stats.misses - misses, worker.media.stats.hits - hits]
    Path(out_dir, "tokens.json").write_text(json.dumps({"tokens": result, "reuse": reuse}))
    coord.shutdown()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_layouts_match_transformers(
    tp: int, pp: int, tmp_path: Path, model_dir: Path, references: dict[str, list[int]]
) -> None:
    run_world(_world_rank, tp, pp, str(model_dir), str(tmp_path), timeout=180)
    result = json.loads((tmp_path / "tokens.json").read_text())
    want = {r: references[r] for r in (*WORLD_REQUESTS, "a_other_text")}
    assert result["tokens"] == want
    misses, hits = result["reuse"]
    assert misses == 0 and hits >= 1  # image a again: from the encoder cache


def test_refuses_media_that_does_not_fit(model_dir: Path, references: dict[str, list[int]]) -> None:
    """Rank 0 refuses an item whose grid, shape, run or kind the model cannot take (a
    ``ValueError`` naming it, before any rank sees it) and keeps serving."""
    import msgspec

    _worker, coord = _coordinator(Comm(single_process_state()), model_dir)
    good = _request("a", model_dir)
    item = good.media[0]
    bad: dict[str, dict[str, Any]] = {
        "not [t, h, w]": {"grid_thw": [1, 6, 7]},
        "t = 1": {"grid_thw": [2, 6, 4]},
        "media shape": {"shape": [96, ckpt.PATCH_DIM // 2]},  # the bytes fit, the patches not
        "placeholder run": {"length": 11},
        "kind": {"kind": "audio"},
        "second_per_grid": {"second_per_grid": float("nan")},
    }
    for message, fields in bad.items():
        media = [msgspec.structs.replace(item, **fields)]
        with pytest.raises(ValueError, match=rf"media\[0\]: .*{re.escape(message)}"):
            coord.add_request(msgspec.structs.replace(good, media=media))
    assert _run(coord, [good]) == {"a": references["a"]}
    coord.shutdown()
