"""The README of ``make bench`` from a result, without running any benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import readme


def _row(system: str, c: int, tok_s: float, layout: str) -> dict[str, Any]:
    return {
        "system": system,
        "dtype": "float32",
        "concurrency": c,
        "layout": layout,
        "output_throughput": tok_s,
    }


def test_readme_has_ratios(tmp_path: Path) -> None:
    result = {
        "machine": {
            "cpu": "X",
            "cores": 2,
            "cores_usable": 2,
            "torch": "t",
            "transformers": "tf",
            "python": "3",
            "date": "d",
        },
        "model": {"parameters": 1e8, "matmul_parameters": 1e8, "flops_per_output_token": 3e8},
        "roofline": {
            "threads": 2,
            "copy_gbps": 20.0,
            "gemm_gflops": {
                "float32": {"decode_64x576x1536": 50.0, "square_2048": 100.0, "peak": 100.0}
            },
        },
        "rows": [
            _row("shardserve", 32, 100.0, "tp1 pp1"),
            _row("hf-serve", 32, 50.0, "tp1 pp1"),
            _row("hf-generate", 32, 80.0, "batch"),
            {  # a point run three times: its median run, every run kept
                **_row("shardserve", 32, 90.0, "pp2 overlapped"),
                "runs": [{"output_throughput": t} for t in (97.0, 84.0, 90.0)],
            },
            _row("shardserve", 32, 60.0, "pp2 not overlapped"),
            _row("shardserve", 32, 90.0, "qwen3-shaped"),
            _row("hf-serve", 32, 30.0, "qwen3-shaped"),
            _row("hf-generate", 32, 45.0, "qwen3-shaped"),
        ],
        "notes": [],
        "wall_s": 60.0,
    }
    result["rows"][0]["metrics"] = {"ttft_ms": {"p50": 212.4}}  # the load tester's TTFT
    path = tmp_path / "README.md"
    readme.write_readme(result, path)
    text = path.read_text()
    assert "| shardserve | float32 | 32 | 100.0 | 2.00× | 1.25× | 30.0 | 30% | 212 | 0.0 |" in text
    assert "| hf-generate | float32 | 32 | 80.0 | 1.60× |  | 24.0 | 24% | — | 0.0 |" in text
    assert "| pp2 not overlapped | 60.0 | 0.60× vs tp1 pp1 | 18.0 |" in text
    assert "| pp2 overlapped | 90.0 (84–97) | 1.50× vs pp2 not overlapped | 27.0 |" in text
    assert "| shardserve | 90.0 | 3.00× | 2.00× |" in text  # the Qwen3-shaped row
    assert "| shardserve | float32 | 32 | 90.0 |" not in text  # not in the Llama table
