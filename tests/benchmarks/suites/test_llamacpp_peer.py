"""The llama.cpp suite without servers: its interleaving, fresh prompts at every point, the
fields llama-server gets, and its table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness.prompts import exact_prompts
from benchmarks.suites import llamacpp_peer as peer
from benchmarks.suites.llamacpp_table import LAYOUT, peer_table
from model_shards.launch.default_model import build_tokenizer

NAMES = ["shardserve bfloat16", "llama.cpp Q4_1", "llama.cpp Q8_0"]


def test_rounds_interleave_and_reverse() -> None:
    plan = peer.schedule(NAMES, [1, 32], {1: 2, 32: 1})
    assert plan[:3] == [(n, peer.WARMUP_REQUESTS, -1) for n in NAMES]
    assert plan[3:6] == [(n, 1, 0) for n in NAMES]
    assert plan[6:9] == [(n, 1, 1) for n in reversed(NAMES)]
    assert plan[9:] == [(n, 32, 0) for n in NAMES]


def test_no_prompt_comes_twice_across_points(tmp_path: Path) -> None:
    plan = peer.schedule(NAMES[:2], [1, 8], {1: 2, 8: 2})
    datasets = peer.write_datasets(build_tokenizer(), plan, tmp_path)
    seen: list[str] = []
    for point in plan:
        lines = Path(datasets[point]).read_text().splitlines()
        assert len(lines) == peer.point_requests(point)
        assert {json.loads(line)["output_len"] for line in lines} == {peer.OUTPUT_LEN}
        seen += [json.loads(line)["prompt"] for line in lines]
    assert len(seen) == len(set(seen)) == 2 * (2 + 2 * 8 + 2 * 16)  # warm-up, c=1, c=8


def test_prompts_of_a_tokenizer_without_bos() -> None:
    tokenizer = build_tokenizer()
    tokenizer.post_processor = None  # SmolLM2's tokenizer adds no BOS
    prompts = exact_prompts(tokenizer, 3, 8, seed="x")
    assert [len(p) for p in prompts] == [8, 8, 8] and all(p[0] != 0 for p in prompts)


def test_llama_server_gets_n_predict_and_types_are_checked() -> None:
    llama = peer.Server("llama.cpp", "Q4_1", "http://x", "", 1)
    assert peer.request_fields(llama) == {"n_predict": 64}
    assert peer.request_fields(peer.Server("shardserve", "bfloat16", "http://y", "", 2)) == {}
    assert peer.parse_types("Q4_1,Q4_K_M") == ["Q4_1", "Q4_K_M"]
    with pytest.raises(argparse.ArgumentTypeError, match="Q5_0"):
        peer.parse_types("Q4_1,Q5_0")


def _row(system: str, dtype: str, c: int, tok_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "system": system,
        "dtype": dtype,
        "concurrency": c,
        "layout": LAYOUT,
        "output_throughput": tok_s,
        **extra,
    }


def test_table_ratios_ttft_and_rss() -> None:
    ours_rss = {"ranks": [612.4], "frontend": 301.0}
    rows = [
        _row(
            "shardserve",
            "bfloat16",
            1,
            30.0,
            metrics={"ttft_ms": {"p50": 41.2}},
            peak_rss_mib=ours_rss,
        ),
        _row("shardserve", "bfloat16", 32, 200.0, peak_rss_mib=ours_rss),
        _row(
            "llama.cpp",
            "Q4_1",
            1,
            60.0,
            metrics={"ttft_ms": {"p50": 20.6}},
            peak_rss_mib={"ranks": [150.2], "frontend": None},
        ),
        _row("llama.cpp", "Q4_1", 32, 400.0),
    ]
    text = peer_table({"rows": rows})
    assert (
        "| Q4_1 | 1 | bfloat16, dequantized | 30.0 | 60.0 | 0.50× | 41 / 21 | 612 / 150 |" in text
    )
    assert "| Q4_1 | 32 | bfloat16, dequantized | 200.0 | 400.0 | 0.50× |  |  |" in text
    assert "frontend process (HTTP, tokenizer; no rank): 301 MiB" in text
    assert "at c=32: 200.0 tok/s; shardserve served no GGUF file" in text
    # once shardserve serves the file: its own row beside llama.cpp's, and against its bf16
    rows.append(_row("shardserve", "Q4_1", 32, 300.0))
    text = peer_table({"rows": rows})
    assert "| Q4_1 | 32 | the Q4_1 file | 300.0 | 400.0 | 0.75× |" in text
    assert "| Q4_1 | 300.0 | 200.0 | 1.50× |" in text
    assert peer_table({"rows": []}) == "(not measured)"
