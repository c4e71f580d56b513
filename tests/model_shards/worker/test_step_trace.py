"""model_shards.worker.step_trace: a traced step stamps each traced request once (first stamp
kept) and hooks the layers only around its forward; OFF hooks and allocates nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model_shards.worker.layer_timer import PREFIX
from model_shards.worker.step_trace import OFF, StepTrace


class _Model(nn.Module):
    """The names the layer timer looks for: ``model.embed_tokens``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(10, 4)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_forward_stamps_every_traced_request_and_unhooks() -> None:
    model, ids = _Model(), torch.tensor([1, 2])
    earlier: dict[str, int] = {"forward_done": 1}  # a chunk of an earlier step stamped it
    fresh: dict[str, int] = {}
    trace = StepTrace([earlier, fresh])
    with trace.forward(model):
        assert _hooks(model) > 0
        model.model.embed_tokens(ids)
    assert _hooks(model) == 0
    assert list(fresh) == ["forward_done", PREFIX + "embedding"] and fresh[PREFIX + "embedding"] > 0
    assert earlier["forward_done"] == 1 and PREFIX + "embedding" in earlier
    trace.stamp("sampled")
    assert earlier["sampled"] == fresh["sampled"] >= fresh["forward_done"]


def test_failed_forward_is_not_stamped() -> None:
    model = _Model()
    stamps: dict[str, int] = {}
    with pytest.raises(RuntimeError), StepTrace([stamps]).forward(model):
        raise RuntimeError("stage failed")
    assert stamps == {} and _hooks(model) == 0


def test_off_hooks_nothing() -> None:
    model = _Model()
    with OFF.forward(model):
        assert _hooks(model) == 0
    OFF.stamp("sampled")
    assert OFF.forward(model) is OFF.forward(model)  # one shared context: no allocation
