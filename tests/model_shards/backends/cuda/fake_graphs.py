"""Graph capture and replay without CUDA, for the tests of :class:`GraphRunner` and the
models' decode graphs on CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model_shards.backends.cuda.graphs import CapturedGraph


class FakeGraphBackend:
    """Graphs without CUDA: a capture runs the callable once and keeps it with its output
    as the static output; a replay runs it again into that output. Counts both."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        self.captures += 1
        return CapturedGraph(fn, fn().clone())

    def replay(self, handle: CapturedGraph) -> torch.Tensor:
        self.replays += 1
        handle.output.copy_(handle.fn())
        return handle.output
