"""``make gpu-check``'s time budget: set-up, the global timeout and every phase's slot fit
8 minutes on one H200, and a phase never eats the slots of the phases after it.

Nothing here starts a process or touches a GPU.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from benchmarks.gpu import check, report
from benchmarks.gpu.parity import PARITY_RUNS
from benchmarks.gpu.phases import MIN_PHASE_S, Run, Skip
from benchmarks.gpu.quant_runs import FORMATS, POINTS
from benchmarks.gpu.settings import (
    DEFAULT_TIMEOUT_S,
    PHASE_SLOTS,
    RESERVE_S,
    SETUP_S,
    WALL_S,
    Budget,
    reserved_after,
    slot_of,
)
from tests.benchmarks.gpu.test_check import RESULTS

# every key the pipeline caps a phase by (Run.time_for / Run.cap), in the order it runs
PIPELINE_KEYS = [
    *(f"parity.{r.key}" for r in PARITY_RUNS),
    "graph_parity",
    "model",
    "quant",
    "step",
    "ceiling",
    "ours",
    *(f"ours.{p}" for p in ("warmup", "c1", "c32")),
    *(f"quant.{f}{p}" for f in FORMATS for p in ("", ".warmup", *(f".{q}" for q in POINTS))),
    "perplexity",
    "perplexity.bf16",
    "hf",
]


def test_the_worst_case_fits_eight_minutes() -> None:
    assert WALL_S == 480.0
    assert SETUP_S + DEFAULT_TIMEOUT_S <= WALL_S
    assert sum(PHASE_SLOTS.values()) <= DEFAULT_TIMEOUT_S - RESERVE_S
    assert all(slot >= MIN_PHASE_S for slot in PHASE_SLOTS.values())
    args = check.parse_args([])
    assert (args.timeout, args.parity_cap) == (DEFAULT_TIMEOUT_S, PHASE_SLOTS["parity"])
    full, smoke = check.settings_from(args), check.settings_from(check.parse_args(["--smoke"]))
    assert full.slots and not smoke.slots


def test_every_capped_phase_has_a_slot_in_pipeline_order() -> None:
    slots = [slot_of(key) for key in PIPELINE_KEYS]
    assert None not in slots
    order = list(PHASE_SLOTS)
    assert [order.index(s) for s in slots if s] == sorted(order.index(s) for s in slots if s)
    assert slot_of("quant.fp8.c1") == "quant.fp8" and slot_of("quant") == "quant"
    assert reserved_after("hf") == 0.0 and slot_of("unknown") is None
    assert reserved_after("parity.backends") == sum(PHASE_SLOTS.values()) - PHASE_SLOTS["parity"]


def _run(tmp_path: Path, timeout_s: float) -> Run:
    settings = check.settings_from(check.parse_args(["--work-dir", str(tmp_path)]))
    return Run(settings, Budget(timeout_s, reserve_s=RESERVE_S), results={"missing": {}})


def test_a_phase_keeps_the_later_slots_free(tmp_path: Path) -> None:
    run = _run(tmp_path, DEFAULT_TIMEOUT_S)  # the whole budget ahead
    left = run.budget.left()
    parity = run.time_for("parity.backends", 1000.0)
    assert parity == pytest.approx(left - reserved_after("parity"), abs=1.0)
    assert parity >= PHASE_SLOTS["parity"]
    assert run.time_for("hf", 1000.0) == pytest.approx(left, abs=1.0)  # nothing after it
    assert run.time_for("step", 30.0) == 30.0  # its own cap below what is free
    late = _run(tmp_path, 120.0)  # as if 320 s had gone: only the last phases' slots are left
    with pytest.raises(Skip, match="kept for the later phases"):
        late.time_for("step", 45.0)
    assert late.time_for("hf", 150.0) == pytest.approx(late.budget.left(), abs=1.0)


def test_the_report_states_the_budget_and_what_it_cut() -> None:
    results = copy.deepcopy(RESULTS)
    settings = check.settings_from(check.parse_args([]))
    results["budget"] = check.new_results(settings)["budget"]
    results["missing"] = {"hf": "HF generate cut at 15 s first", "quant.awq": "not started: 3 s"}
    text = report.render(results)
    assert "- time: set-up 40 s + --timeout 440 s (15 s of it to stop and report) = 480 s" in text
    assert "parity 100, graph_parity 30," in text and "(s, sum 420)" in text
    assert "- cut by the budget: hf, quant.awq" in text
