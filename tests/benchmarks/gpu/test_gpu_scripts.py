"""The check's device scripts run end to end on CPU on the smoke shape: their events, in
order, with the fields the report reads (the numbers themselves mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu import ceiling, step_breakdown
from benchmarks.gpu.build_model import write_checkpoint
from benchmarks.gpu.phases import parse_events
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
                 prompt_len=8, steps=3, batches=[1, 2], copy_bytes=1 << 20)  # fmt: skip
    assert step_breakdown.main([spec]) == 0
    events = parse_events(capsys.readouterr().out)
    assert [e["event"] for e in events] == ["copy", "linear", "step", "step", "kernels"]
    assert events[0]["gb_s"] > 0
    linear = events[1]["rows"]
    assert [(r["matrix"], r["m"]) for r in linear[:2]] == [("qkv", 1), ("qkv", 32)]
    assert len(linear) == 10 and all(r["gb_s"] > 0 and r["copy_pct"] > 0 for r in linear)
    assert linear[-1]["shape"] == [SMOKE.vocab, SMOKE.hidden]
    for event, batch in zip(events[2:4], (1, 2), strict=True):
        assert event["batch"] == batch and event["engine_ms"] > 0
        assert event["replay_ms"] is None and not event["graphed"]  # no graphs on CPU
    assert events[4]["batch"] == 1 and events[4]["steps"] == 3


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
