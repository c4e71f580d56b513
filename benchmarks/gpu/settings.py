"""What one ``make gpu-check`` run does (:class:`Settings`) and its time (:class:`Budget`).

The full run ends inside 8 minutes on one H200, set-up included (:data:`WALL_S`): the
wheels' install (:data:`SETUP_S`), then the check's global ``--timeout``
(:data:`DEFAULT_TIMEOUT_S`), whose last :data:`RESERVE_S` stop the servers and write the
reports. Inside it every phase has a slot (:data:`PHASE_SLOTS`, summing within the
timeout): a phase may run past its slot (up to its own cap) only on time the phases before
it left unused, never on the later phases' slots, so in the worst case each phase still
gets its slot and one that overruns is cut (the report says where) instead of starving
the rest. ``--smoke`` is the same pipeline on a tiny shape with short lengths, sized for
a shared CPU, without slots.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu.shapes import SHAPES, LlamaShape

WORK_DIR = Path("/tmp/shardserve-gpu-check")

WALL_S = 480.0  # one H200, `benchmarks/gpu/wheels.sh --install` and `make gpu-check` (issue 43)
SETUP_S = 40.0  # the install from wheels/ (no network) and the interpreter's start, worst case
RESERVE_S = 15.0  # of the timeout: servers stopped, reports written
DEFAULT_TIMEOUT_S = WALL_S - SETUP_S
# Each phase's guaranteed seconds, in the pipeline's order (``Run.time_for``'s keys: a key
# belongs to the longest slot name it starts with). Their sum is within the timeout less its
# reserve (tests/benchmarks/gpu/test_check.py checks it).
PHASE_SLOTS: dict[str, float] = {
    "parity": 100.0,  # the three pytest runs, by their shares (--parity-cap's default)
    "graph_parity": 30.0,  # every family's tiny checkpoint, eager and graphed
    "model": 10.0,  # the wait for the 8B checkpoint, built while the tests run
    "quant": 10.0,  # the wait for its FP8 and AWQ copies, quantized meanwhile
    "prompts": 5.0,
    "step": 60.0,  # 8B loaded and graphed; copy, F.linear, fusions, steps, profiler, mixed
    "ceiling": 70.0,  # the compiled plain-PyTorch decoder, batch 1 then 32
    "ours": 50.0,  # our server's start-up (27 s on the first H200 run) and its three points
    "quant.fp8": 25.0,
    "quant.awq": 25.0,
    "perplexity": 20.0,  # SmolLM2-135M served twice
    "hf": 15.0,  # last: HF generate(), the first cut
}


def slot_of(key: str) -> str | None:
    """The :data:`PHASE_SLOTS` name ``key`` belongs to (``"ours.c1"`` → ``"ours"``)."""
    names = [n for n in PHASE_SLOTS if key == n or key.startswith(f"{n}.")]
    return max(names, key=len) if names else None


def reserved_after(key: str) -> float:
    """Seconds the phases after ``key``'s slot are guaranteed (0 for a key of no slot)."""
    name = slot_of(key)
    if name is None:
        return 0.0
    order = list(PHASE_SLOTS)
    return sum(PHASE_SLOTS[n] for n in order[order.index(name) + 1 :])


class Deadline(BaseException):
    """The global ``--timeout`` (or SIGTERM) arrived: stop everything, write the reports."""


@dataclass(frozen=True, slots=True)
class Settings:
    smoke: bool
    shape_name: str
    device: str
    dtype: str
    model_dir: Path
    work_dir: Path
    logs_dir: Path
    out_dir: Path
    timeout_s: float
    parity: bool
    parity_cap_s: float
    peak_bw: float | None
    prompt_len: int = 128
    output_c1: int = 128
    output_c32: int = 64
    requests_c1: int = 4
    requests_c32: int = 64  # two waves of 32
    warmup_requests: int = 32
    warmup_output: int = 8
    max_num_seqs: int = 64
    max_model_len: int = 4096
    build_cap_s: float = 240.0
    start_cap_s: float = 180.0  # not ready by then: the start-up target is missed anyway
    point_cap_s: float = 60.0
    hf_cap_s: float = 150.0  # last: what the budget leaves
    slots: bool = True  # keep the later phases' PHASE_SLOTS free (off with --smoke)
    graph_parity_cap_s: float = 60.0
    step_cap_s: float = 90.0
    ceiling_cap_s: float = 150.0  # two torch.compile runs of the 8B decoder

    @property
    def shape(self) -> LlamaShape:
        return SHAPES[self.shape_name]

    def mean_context(self) -> float:
        """Mean context length of a batch-1 decode step: the KV read it adds."""
        return self.prompt_len + self.output_c1 / 2

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


SMOKE_OVERRIDES: dict[str, Any] = {
    "prompt_len": 16,
    "output_c1": 16,
    "output_c32": 8,
    "requests_c1": 2,
    "requests_c32": 32,
    "warmup_requests": 2,
    "warmup_output": 2,
    "max_model_len": 512,
    "point_cap_s": 30.0,
    "slots": False,
}


class Budget:
    """Seconds left before the global deadline, less a reserve for the clean-up."""

    def __init__(self, timeout_s: float, reserve_s: float = 15.0) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.reserve_s = reserve_s

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.deadline - self.reserve_s - time.monotonic()

    def cap(self, seconds: float) -> float:
        """``seconds``, or what is left if that is less (never negative)."""
        return max(0.0, min(seconds, self.left()))
