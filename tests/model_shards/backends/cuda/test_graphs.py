"""CUDA-graph decode runner on CPU: buckets, static-input padding, one host->device copy
per step, and replay (:class:`FakeGraphBackend`) agreeing with an eager forward.

The toy forward embeds token ids (or takes the hidden rows), stores each row at its slot
of a fake KV pool (slot -1 goes to a trash row) and adds the sum of the pool over each
row's context through its block table; rows with context 0 answer zeros."""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from model_shards.backends.cuda.graphs import (
    DecodeInputs,
    DecodeStep,
    GraphRunner,
    StaticDecodeInputs,
    bucket_for,
    decode_buckets,
    eager_inputs,
)
from tests.model_shards.backends.cuda.fake_graphs import FakeGraphBackend

VOCAB, HID, BS, NUM_BLOCKS, WIDTH = 11, 8, 4, 64, 4  # WIDTH: static table width (blocks)
CPU = torch.device("cpu")
DT = torch.float64


class ToyModel:
    """A decode forward reading every input; its KV pool has a trash row for slot -1."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(VOCAB, HID, generator=g, dtype=DT)
        self.pool = torch.randn(NUM_BLOCKS * BS + 1, HID, generator=g, dtype=DT)

    def forward(self, x: DecodeInputs) -> torch.Tensor:
        h = self.embed[x.token_ids] if x.hidden is None else x.hidden  # [n, H]
        h = h + 0.01 * x.positions[:, None].to(DT)
        trash = self.pool.shape[0] - 1
        self.pool.index_copy_(0, torch.where(x.slot_mapping >= 0, x.slot_mapping, trash), h)
        span = torch.arange(x.block_tables.shape[1] * BS)  # [nblk * bs]
        slots = x.block_tables[:, span // BS] * BS + span % BS  # [n, nblk * bs]
        mask = span[None, :] < x.context_lens[:, None]  # [n, nblk * bs]
        ctx = (self.pool[slots] * mask[..., None]).sum(1)  # [n, H]
        return torch.where(x.context_lens[:, None] > 0, h + ctx, 0.0)


def make_step(rng: random.Random, b: int, hidden: bool = False) -> DecodeStep:
    """``b`` decodes on disjoint blocks, ragged tables, each new token at its last slot."""
    blocks = rng.sample(range(NUM_BLOCKS), b * WIDTH)
    tables, lens, slots = [], [], []
    for r in range(b):
        length = rng.randint(1, WIDTH * BS)
        table = blocks[r * WIDTH : r * WIDTH + -(-length // BS)]
        tables.append(table)
        lens.append(length)
        slots.append(table[(length - 1) // BS] * BS + (length - 1) % BS)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return DecodeStep(
        positions=[n - 1 for n in lens],
        slot_mapping=slots,
        block_tables=tables,
        context_lens=lens,
        token_ids=None if hidden else [rng.randrange(VOCAB) for _ in range(b)],
        hidden=torch.randn(b, HID, generator=g, dtype=DT) if hidden else None,
    )


def exact_inputs(step: DecodeStep) -> DecodeInputs:
    """The step's unpadded inputs, built independently of the module under test."""
    b = step.num_rows
    width = max(len(t) for t in step.block_tables)
    tables = [list(t) + [0] * (width - len(t)) for t in step.block_tables]
    i64 = torch.int64
    return DecodeInputs(
        token_ids=torch.tensor(step.token_ids or [0] * b, dtype=i64),
        positions=torch.tensor(step.positions, dtype=i64),
        slot_mapping=torch.tensor(step.slot_mapping, dtype=i64),
        block_tables=torch.tensor(tables, dtype=i64),
        context_lens=torch.tensor(step.context_lens, dtype=i64),
        hidden=step.hidden,
    )


def make_runner(
    max_num_seqs: int, hidden: bool = False, enforce_eager: bool = False
) -> tuple[GraphRunner, FakeGraphBackend, ToyModel, StaticDecodeInputs]:
    model, fake = ToyModel(), FakeGraphBackend()
    static = StaticDecodeInputs(
        max_num_seqs, WIDTH, CPU, hidden_size=HID if hidden else None, hidden_dtype=DT
    )
    runner = GraphRunner(
        model.forward, static, decode_buckets(max_num_seqs), fake, enforce_eager=enforce_eager
    )
    return runner, fake, model, static


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (5, [1, 2, 4, 5]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
        (64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
        (100, [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]),
    ],
)
def test_decode_buckets(max_num_seqs: int, expected: list[int]) -> None:
    assert decode_buckets(max_num_seqs) == expected


def test_bucket_for_edges() -> None:
    buckets = [1, 2, 4, 5]
    assert [bucket_for(b, buckets) for b in range(1, 7)] == [1, 2, 4, 4, 5, None]
    assert bucket_for(33, decode_buckets(32)) is None
    with pytest.raises(ValueError):
        decode_buckets(0)
    with pytest.raises(ValueError):
        bucket_for(0, buckets)


def expect_views(
    static: StaticDecodeInputs,
    n: int,
    tokens: list[int],
    positions: list[int],
    slots: list[int],
    lens: list[int],
    tables: list[list[int]],
) -> None:
    """The bucket-``n`` views hold these real rows and padding everywhere else."""
    pad = n - len(positions)
    full = [list(t) + [0] * (WIDTH - len(t)) for t in tables] + [[0] * WIDTH] * pad
    v = static.views(n)
    assert v.token_ids.tolist() == tokens + [0] * pad
    assert v.positions.tolist() == positions + [0] * pad
    assert v.slot_mapping.tolist() == slots + [-1] * pad
    assert v.context_lens.tolist() == lens + [0] * pad
    assert v.block_tables.shape == (n, WIDTH)
    assert v.block_tables.tolist() == full
    assert v.hidden is None


def test_fill_pads_every_buffer_and_repads_stale_rows() -> None:
    static = StaticDecodeInputs(5, WIDTH, CPU)
    big = DecodeStep([4, 9, 2], [17, 38, 6], [[3], [7, 9, 1], [1]], [5, 10, 3], [7, 8, 9])
    static.fill(5, big)
    expect_views(static, 5, [7, 8, 9], [4, 9, 2], [17, 38, 6], [5, 10, 3], [[3], [7, 9, 1], [1]])
    small = DecodeStep([0], [44], [[11]], [1], [6])
    static.fill(5, small)  # same bucket: rows 1, 2 and the wide table row are stale
    expect_views(static, 5, [6], [0], [44], [1], [[11]])
    static.fill(5, big)
    static.fill(4, small)  # a smaller bucket over a larger one's data
    expect_views(static, 4, [6], [0], [44], [1], [[11]])
    static.fill(2, DecodeStep([3, 1], [2, 5], [[2, 8], [4]], [4, 2], [1, 2]))  # full bucket
    expect_views(static, 2, [1, 2], [3, 1], [2, 5], [4, 2], [[2, 8], [4]])


def test_future_tokens_are_read_from_the_previous_samples_in_graph_and_eager_inputs() -> None:
    """Async scheduling: ids ``-(1 + i)`` become the previous step's ``i``-th sample."""
    sampled = torch.tensor([41, 42, 43])
    step = DecodeStep(
        [4, 9, 2], [17, 38, 6], [[3], [7], [1]], [5, 10, 3], [-3, 8, -1], None, sampled
    )
    static = StaticDecodeInputs(4, WIDTH, CPU)
    assert static.fill(4, step).token_ids.tolist() == [43, 8, 41, 0]
    assert eager_inputs(step, CPU).token_ids.tolist() == [43, 8, 41]


def test_fill_hidden_stage_pads_hidden_rows() -> None:
    static = StaticDecodeInputs(4, WIDTH, CPU, hidden_size=HID, hidden_dtype=DT)
    rng = random.Random(1)
    static.fill(4, make_step(rng, 3, hidden=True))
    step = make_step(rng, 1, hidden=True)
    v = static.fill(4, step)
    assert step.hidden is not None and v.hidden is not None
    assert v.hidden.shape == (4, HID)
    torch.testing.assert_close(v.hidden[:1], step.hidden, rtol=0, atol=0)
    assert not v.hidden[1:].any()
    assert v.token_ids.tolist() == [0, 0, 0, 0]
    assert v.slot_mapping.tolist()[1:] == [-1, -1, -1]
    with pytest.raises(ValueError, match="hidden"):
        static.fill(4, make_step(rng, 1))


def test_fill_rejects_bad_steps() -> None:
    static = StaticDecodeInputs(4, WIDTH, CPU)
    with pytest.raises(ValueError, match="static width"):
        static.fill(4, DecodeStep([0], [0], [[1] * (WIDTH + 1)], [1], [0]))
    with pytest.raises(ValueError, match="rows"):
        static.fill(4, DecodeStep([0, 1], [0], [[1], [2]], [1, 2], [0, 0]))
    with pytest.raises(ValueError, match="bucket"):
        static.fill(2, DecodeStep([0] * 3, [0] * 3, [[1]] * 3, [1] * 3, [0] * 3))
    with pytest.raises(ValueError, match="bucket"):
        static.fill(5, DecodeStep([0], [0], [[1]], [1], [0]))
    with pytest.raises(ValueError, match="exceeds"):
        GraphRunner(ToyModel().forward, static, [1, 8], FakeGraphBackend())


@pytest.mark.parametrize("hidden", [False, True])
def test_run_matches_eager_forward(hidden: bool) -> None:
    runner, fake, model, _ = make_runner(5, hidden=hidden)
    eager = copy.deepcopy(model)
    runner.capture_all()
    model.pool.copy_(eager.pool)  # captures ran the forward on padding rows (trash only)
    rng = random.Random(2)
    sizes = [5, 3, 1, 4, 2, 5, 1]  # every bucket, exact and padded, growing and shrinking
    for i, b in enumerate(sizes):
        step = make_step(rng, b, hidden=hidden)
        out = runner.run(step)
        assert fake.replays == i + 1
        torch.testing.assert_close(out, eager.forward(exact_inputs(step)))
        torch.testing.assert_close(model.pool[:-1], eager.pool[:-1])  # same K/V stored


def test_capture_all_captures_every_bucket_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    runner, fake, _, _ = make_runner(32)
    with caplog.at_level(logging.INFO, logger="model_shards.backends.cuda.graphs"):
        seconds = runner.capture_all()
    assert fake.captures == len(decode_buckets(32)) == 7
    assert fake.replays == 0
    assert seconds >= 0.0
    assert "captured 7 CUDA graphs (batch 1, 2, 4, 8, 16, 24, 32)" in caplog.text


def test_capture_runs_on_padding_only() -> None:
    runner, _, model, _ = make_runner(5)
    before = model.pool.clone()
    runner.capture_all()
    torch.testing.assert_close(model.pool[:-1], before[:-1], rtol=0, atol=0)


def test_eager_above_largest_bucket() -> None:
    runner, fake, model, static = make_runner(5)
    eager = copy.deepcopy(model)
    runner.capture_all()
    model.pool.copy_(eager.pool)
    copies = static.h2d_copies
    step = make_step(random.Random(3), 7)
    out = runner.run(step)
    assert out.shape == (7, HID)
    assert fake.replays == 0 and static.h2d_copies == copies
    torch.testing.assert_close(out, eager.forward(exact_inputs(step)))
    torch.testing.assert_close(model.pool, eager.pool)


def test_graph_for_names_the_graph_a_step_replays() -> None:
    runner, fake, _, _ = make_runner(5)
    step = make_step(random.Random(4), 3)
    assert runner.graph_for(step) is None  # nothing captured yet
    runner.capture_all()
    handle = runner.graph_for(step)
    assert handle is not None and handle.output.shape[0] == 4  # bucket 4 holds 3 rows
    assert runner.graph_for(make_step(random.Random(5), 7)) is None  # eager above 5
    replays = fake.replays
    assert fake.replay(handle) is handle.output and fake.replays == replays + 1


def test_enforce_eager_captures_nothing() -> None:
    runner, fake, model, static = make_runner(5, enforce_eager=True)
    eager = copy.deepcopy(model)
    assert runner.capture_all() == 0.0
    rng = random.Random(4)
    for b in (1, 3, 5):
        step = make_step(rng, b)
        torch.testing.assert_close(runner.run(step), eager.forward(exact_inputs(step)))
    assert fake.captures == fake.replays == static.h2d_copies == 0


def count_calls(
    monkeypatch: pytest.MonkeyPatch, name: str, into: torch.Tensor
) -> Callable[[], int]:
    """Count ``torch.Tensor.<name>`` calls on tensors sharing ``into``'s storage."""
    original = getattr(torch.Tensor, name)
    ptr = into.untyped_storage().data_ptr()
    calls = [0]

    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.untyped_storage().data_ptr() == ptr:
            calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, name, wrapper)
    return lambda: calls[0]


def test_one_host_to_device_copy_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    runner, fake, _, static = make_runner(5)
    runner.capture_all()
    device_buf = static.views(1).positions
    copies = count_calls(monkeypatch, "copy_", device_buf)
    setitems = count_calls(monkeypatch, "__setitem__", device_buf)
    rng = random.Random(5)
    for i, b in enumerate((5, 2, 3), start=1):
        runner.run(make_step(rng, b))
        assert copies() == i and setitems() == 0
    assert fake.replays == 3


def test_context_bounds_replay_the_smallest_graph_holding_the_step() -> None:
    """Buckets 1 and 2 captured at context bounds 4 and 16, the others at 16 only: a step
    replays its bucket's graph of the smallest bound >= its longest context, whose forward
    was told that bound; an eager step is told its own longest context."""
    model, fake = ToyModel(), FakeGraphBackend()
    eager = copy.deepcopy(model)
    seen: list[int | None] = []

    def forward(x: DecodeInputs) -> torch.Tensor:
        seen.append(x.context_bound)
        return model.forward(x)

    static = StaticDecodeInputs(5, WIDTH, CPU, hidden_dtype=DT)
    bounds = lambda n: [4, WIDTH * BS] if n <= 2 else [WIDTH * BS]  # noqa: E731
    runner = GraphRunner(forward, static, decode_buckets(5), fake, context_bounds=bounds)
    runner.capture_all()
    assert fake.captures == 6 and sorted(set(seen), key=str) == [16, 4]
    model.pool.copy_(eager.pool)
    rng = random.Random(6)
    chosen: set[int] = set()
    for b in (1, 2, 1, 1, 2, 3, 5, 1, 1, 7):
        step = make_step(rng, b)
        longest = max(step.context_lens)
        seen.clear()
        out = runner.run(step)
        n = bucket_for(b, decode_buckets(5))
        if n is None:
            assert runner.graph_key(step) is None and seen == [longest]
        else:
            bound = 4 if n <= 2 and longest <= 4 else WIDTH * BS
            assert runner.graph_key(step) == (n, bound) and seen == [bound]
            chosen.add(bound)
        torch.testing.assert_close(out, eager.forward(exact_inputs(step)))
    assert fake.replays == 9 and chosen == {4, 16}
