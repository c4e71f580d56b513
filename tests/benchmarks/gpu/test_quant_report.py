"""The gpu-check's FP8 / AWQ / perplexity parts that need no GPU: their commands (parsed by
the programs that run them), the pipeline's order, and the report's rows and targets."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpu import (
    check,
    perplexity_phase,
    quant_checkpoints,
    quant_report,
    quant_runs,
    report,
)
from benchmarks.gpu.phases import Run
from benchmarks.gpu.settings import Budget
from server.cli.args import build_parser
from tests.benchmarks.gpu.test_check import RESULTS  # bf16: c=1 decode 250, c=32 4000 tok/s


def _run(*flags: str) -> Run:
    settings = check.settings_from(check.parse_args(list(flags)))
    return Run(settings, Budget(100.0), results={"missing": {}, "notes": []})


def test_quantizer_command_is_the_full_shape_on_the_gpu() -> None:
    run = _run()
    command = quant_runs.build_command(run)
    assert command[1:5] == ["-m", "benchmarks", "gpu", "quant_checkpoints"]
    args = quant_checkpoints.parser().parse_args(command[5:])
    assert (args.dense, args.root) == (run.settings.model_dir, run.settings.model_dir.parent)
    assert (args.device, args.shape, args.dtype, args.group_size) == (
        "cuda",
        "llama3-8b",
        "bfloat16",
        128,
    )
    assert args.formats.split(",") == list(quant_runs.FORMATS)
    assert args.wait_s == quant_runs.BUILD_WAIT_S
    smoke = quant_checkpoints.parser().parse_args(quant_runs.build_command(_run("--smoke"))[5:])
    assert (smoke.device, smoke.shape, smoke.group_size) == ("cpu", "smoke", 64)


def test_perplexity_commands_differ_only_by_fp8() -> None:
    run = _run("--work-dir", "/tmp/w")
    parsed = {}
    for label in perplexity_phase.VARIANTS:
        command = perplexity_phase.variant_command(run, label, 8123)
        assert command[1:4] == ["-m", "server.cli", "serve"]
        parsed[label] = build_parser().parse_args(command[3:])
    bf16, fp8 = parsed["bf16"], parsed["fp8"]
    assert Path(bf16.model) == Path("/tmp/w/smollm2-135m-bf16") == Path(fp8.model)
    assert (bf16.device, bf16.dtype, bf16.port) == ("cuda", "bfloat16", 8123)
    assert (bf16.quantization, fp8.quantization) == (None, "fp8")
    assert {k: v for k, v in vars(fp8).items() if k != "quantization"} == {
        k: v for k, v in vars(bf16).items() if k != "quantization"
    }
    assert perplexity_phase.score([math.log(0.5)] * 4) == {
        "tokens": 4,
        "nll": pytest.approx(math.log(2)),
        "ppl": pytest.approx(2.0),
    }


def test_pipeline_quantizes_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def record(name: str, value: Any = None) -> Any:
        def fn(*args: Any) -> Any:
            calls.append(name)
            return value

        return fn

    for module, name, value in [
        (check.phases, "start_build", None),
        (check.phases, "parity", None),
        (check.phases, "finish_build", True),
        (check.phases, "make_prompts", {}),
        (check.phases, "write_datasets", {"c1": "x"}),
        (check.phases, "ours", None),
        (check.phases, "hf", None),
        (quant_runs, "start_build", None),
        (quant_runs, "finish_build", {}),
        (quant_runs, "serve_all", None),
        (perplexity_phase, "start_prep", None),
        (perplexity_phase, "perplexity", None),
    ]:
        monkeypatch.setattr(
            module, name, record(f"{module.__name__.rsplit('.')[-1]}.{name}", value)
        )
    check.pipeline(_run("--smoke"))
    assert calls == [
        "phases.start_build",
        "quant_runs.start_build",
        "perplexity_phase.start_prep",
        "phases.parity",
        "phases.finish_build",
        "quant_runs.finish_build",  # the quantizer is done before any server is measured
        "phases.make_prompts",
        "phases.write_datasets",
        "phases.ours",
        "quant_runs.serve_all",
        "perplexity_phase.perplexity",
        "phases.hf",  # last: the first the budget cuts
    ]


QUANT = {
    "fp8": {
        "bytes_per_token": 8e9,
        "c1": {"decode_tok_s": 450.0},  # 1.8× bf16's 250
        "c32": {"output_tok_s": 4800.0},  # 1.2× bf16's 4000
    },
    "awq": {"bytes_per_token": 4.8e9, "c1": {"decode_tok_s": 600.0}},  # 2.4×
}
PERPLEXITY = {"bf16": {"ppl": 16.80, "tokens": 2219}, "fp8": {"ppl": 16.95, "tokens": 2219}}


def _table(results: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {row[0]: row[1:] for row in quant_report.rows(results)}


def test_report_rows_and_targets() -> None:
    results = {**copy.deepcopy(RESULTS), "quant": QUANT, "perplexity": PERPLEXITY}
    results["missing"] = {"quant.awq.c32": "ReadTimeout: cut"}
    table = _table(results)
    assert table["FP8 c=1 decode tok/s"] == ("450.0 tok/s (1000 / median TPOT)", "", "")
    assert table["FP8 c=1 % of HBM roofline"][0].startswith("75.0 % (450.0 tok/s × 8.00 GB")
    assert table["FP8 c=1 decode / bf16 c=1 decode"] == (
        "1.80× (450.0 / 250.0 tok/s)",
        "≥ 1.7×",
        "met",
    )
    assert table["FP8 c=32 / bf16 c=32"] == ("1.20× (4800.0 / 4000.0 tok/s)", "≥ 1.3×", "not met")
    assert table["AWQ c=1 decode / bf16 c=1 decode"][1:] == ("≥ 2.5×", "not met")
    assert table["AWQ c=1 % of HBM roofline"][0].startswith("60.0 %")
    assert table["AWQ c=32 output tok/s"] == ("missing: ReadTimeout: cut", "", "missing")
    assert (
        table["AWQ c=32 / bf16 c=32"][0]
        == "missing: needs quant.awq.c32.output_tok_s (ReadTimeout: cut)"
    )
    assert table["SmolLM2 perplexity, bfloat16 on cuda"][0] == "16.8000 (2219 tokens)"
    assert table["SmolLM2 perplexity, FP8 vs bf16"] == (
        "+0.89 % (16.9500 vs 16.8000)",
        "≤ +1 %",
        "met",
    )
    results["perplexity"]["fp8"]["ppl"] = 17.0
    assert _table(results)["SmolLM2 perplexity, FP8 vs bf16"][2] == "not met"
    assert "| FP8 c=32 / bf16 c=32 | 1.20×" in report.render(results)


def test_report_names_what_is_missing() -> None:
    results = copy.deepcopy(RESULTS)
    results["missing"] = {"quant.fp8": "checkpoint: quantizer exited with 1", "perplexity": "x"}
    del results["ours"]["c32"]
    results["quant"] = {"awq": {"bytes_per_token": 4.8e9, "c32": {"output_tok_s": 9000.0}}}
    check.fill_missing(results, "not reached")
    table = _table(results)
    assert table["FP8 c=1 decode tok/s"][0] == "missing: checkpoint: quantizer exited with 1"
    assert "needs fp8 c=1 decode tok/s (checkpoint" in table["FP8 c=1 % of HBM roofline"][0]
    assert table["AWQ c=1 decode tok/s"] == ("missing: not reached", "", "missing")
    assert table["AWQ c=32 / bf16 c=32"][0] == "missing: needs ours.c32.output_tok_s (not reached)"
    assert all(v[2] == "missing" for k, v in table.items() if k.startswith("SmolLM2"))
    for key in (*quant_runs.EXPECTED, *perplexity_phase.EXPECTED):
        assert key == "quant.awq.c32" or report.reason(results, key) != "not measured", key
