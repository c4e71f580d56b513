"""What one ``make gpu-check`` run does (:class:`Settings`) and its time (:class:`Budget`).

The full run is sized to end inside 8 minutes on one H200: the parity tests have their
own cap, every later phase is capped by what the global ``--timeout`` leaves, less a
reserve for stopping the server and writing the reports. ``--smoke`` is the same
pipeline on a tiny shape with short lengths, sized for a shared CPU.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu.shapes import SHAPES, LlamaShape

WORK_DIR = Path("/tmp/shardserve-gpu-check")


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
