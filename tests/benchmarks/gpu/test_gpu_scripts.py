"""The check's device scripts run end to end on CPU on the smoke shape: their events, in
order, with the fields the report reads (the numbers themselves mean nothing here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.gpu import ceiling, check, phases, phases_device, step_breakdown
from benchmarks.gpu.build_model import write_checkpoint
from benchmarks.gpu.parity import PARITY_RUNS
from benchmarks.gpu.phases import parse_events
from benchmarks.gpu.settings import Budget
from benchmarks.gpu.shapes import SMOKE


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("smoke") / "llama"
    write_checkpoint(path, SMOKE, "cpu", "float32")
    return path


def _spec(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(fields))
    return str(path)


def test_step_breakdown_events(
    smoke_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, model_dir=str(smoke_dir), device="cpu", dtype="float32",
                 prompt_len=8, steps=3, batches=[1, 2], copy_bytes=1 << 20,
                 async_scheduling=True)  # fmt: skip
    assert step_breakdown.main([spec]) == 0
    events = parse_events(capsys.readouterr().out)
    names = ["copy", "linear", "fusions", "step", "step", "kernels", "mixed"]
    assert [e["event"] for e in events] == names
    assert events[0]["gb_s"] > 0
    linear = events[1]["rows"]
    assert [(r["matrix"], r["m"]) for r in linear[:2]] == [("qkv", 1), ("qkv", 32)]
    assert len(linear) == 10 and all(r["gb_s"] > 0 and r["copy_pct"] > 0 for r in linear)
    assert linear[-1]["shape"] == [SMOKE.vocab, SMOKE.hidden]
    fusions = events.pop(2)  # Triton's interpreter here (the tests' TRITON_INTERPRET=1)
    assert fusions["errors"] == {}
    rows = {(r["fusion"], r["m"]): r for r in fusions["rows"]}
    assert sorted(rows) == [("add_norm", 1), ("gate_up_silu", 1), ("qk_norm_rope", 1)]
    assert all(r["bitwise"] for (name, _), r in rows.items() if name != "gate_up_silu")
    assert all(r["unfused_ms"] > 0 and r["fused_ms"] > 0 for r in rows.values())
    for event, batch in zip(events[2:4], (1, 2), strict=True):
        assert event["batch"] == batch and event["engine_ms"] > 0
        assert event["replay_ms"] is None and not event["graphed"]  # no graphs on CPU
        assert event["async_ms"] > 0 and event["async_gap_ms"] is None
    assert events[4]["batch"] == 1 and events[4]["steps"] == 3
    assert events[4]["rows"] == [] and events[4]["launches_per_step"] == 0  # no device on CPU
    mixed = events[5]  # no graphs on CPU: eager only
    assert (mixed["tokens"], mixed["bucket"], mixed["piecewise_ms"]) == (31 + 8, None, None)
    assert mixed["eager_ms"] > 0


def test_ceiling_events(
    smoke_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, model_dir=str(smoke_dir), device="cpu", dtype="float32",
                 prompt_len=8, new_tokens=4, batches=[1, 3], compile=False)  # fmt: skip
    assert ceiling.main([spec]) == 0
    events = parse_events(capsys.readouterr().out)
    assert [e["event"] for e in events] == ["loaded", "point", "point"]
    assert [e["batch"] for e in events[1:]] == [1, 3]
    for e in events[1:]:
        assert e["steps"] == 4 and e["tok_s"] == pytest.approx(e["batch"] * 4 / e["seconds"])


def _run(tmp_path: Path, **overrides: object) -> phases.Run:
    args = check.parse_args(["--smoke", "--work-dir", str(tmp_path), "--timeout", "120"])
    settings = dataclasses.replace(check.settings_from(args), **overrides)  # type: ignore[arg-type]
    settings.logs_dir.mkdir(parents=True, exist_ok=True)
    return phases.Run(settings, Budget(120.0, reserve_s=5.0), results={"missing": {}})


def test_a_failing_script_phase_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    run = _run(tmp_path, model_dir=tmp_path / "absent")
    phases_device.ceiling(run)  # no checkpoint there: the script exits with an error
    assert run.results["ceiling"] == {}
    why = run.results["missing"]["ceiling"]
    assert why.startswith("ceiling exited with 1; log tail:") and "config.json" in why
    run.procs.stop_all()


def test_a_phase_without_time_left_is_skipped(tmp_path: Path) -> None:
    run = _run(tmp_path, step_cap_s=1.0)  # under the phases' 5 s minimum
    phases_device.step_breakdown(run)
    assert run.results["step"] == {}
    assert run.results["missing"]["step"].startswith("not started:")


def test_parity_runs_skipped_without_parity(tmp_path: Path) -> None:
    run = _run(tmp_path)
    phases.parity(run)
    assert set(run.results["missing"]) == {f"parity.{r.key}" for r in PARITY_RUNS}
    assert [r.key for r in PARITY_RUNS] == ["backends", "bfloat16", "tp2_shared"]
    assert sum(r.share for r in PARITY_RUNS) == pytest.approx(1.0)
    assert dict(PARITY_RUNS[2].env) == {"SHARDSERVE_SHARED_GPU": "1"}
