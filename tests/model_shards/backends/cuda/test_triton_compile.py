"""The Triton kernels of quantized weights (W4A16, FP8 W8A8) and FP8 K/V pools compile for
sm90 (H100/H200) and, the FP8 ones, sm80 (A100): :mod:`.compile_kernels` in a process with
the interpreter off, no GPU needed. The interpreter tests check the numbers; this checks
what only a compiled kernel refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.timeout(300)
def test_kernels_compile_for_sm90_and_sm80() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    module = "tests.model_shards.backends.cuda.compile_kernels"
    done = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert len(lines) == 17 + 9 and all(line.startswith("ok") for line in lines), lines
