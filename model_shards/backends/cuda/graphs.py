"""CUDA graphs of decode-only steps: static inputs, one capture per batch bucket, replay.

A decode-only step of ``B`` sequences reads, per row: ``token_ids [B]`` (stage 0; later
pipeline stages read ``hidden [B, H]`` instead), ``positions [B]``, ``slot_mapping [B]``
(where each new K/V goes), ``block_tables [B, nblk]`` (padded with 0) and
``context_lens [B]``, all int64. At start-up :class:`GraphRunner` captures the model's
decode forward once per bucket of :func:`decode_buckets` (largest first, one memory pool
shared by all graphs); a step of ``B`` rows then replays the graph of the smallest bucket
``n >= B`` and keeps the first ``B`` rows of its output. Rows ``B .. n - 1`` are padding:
token 0, position 0, slot -1 (the kernels store nothing), block-table row 0, context 0
(decode attention answers zeros), hidden 0. Steps larger than every bucket, and every
step under ``enforce_eager``, call the forward eagerly on exact-size inputs.

One host->device copy per step: the int inputs of a bucket-``n`` step are packed back to
back into one int64 buffer, ``n * (4 + W)`` long with ``W = max_blocks`` the static table
width (``ceil(max_model_len / block_size)``)::

    [token_ids n | positions n | slot_mapping n | context_lens n | block_tables n * W]

Python ints are written into a pinned host staging buffer (two, alternated, each fenced
by a CUDA event so the CPU never overwrites a copy still queued), one
``copy_(non_blocking=True)`` moves the prefix into the device buffer, and the graph of
bucket ``n`` reads contiguous views of that prefix, fixed at capture. A step's narrower
table fills the left columns; the rest are zeroed.

Nothing on the replay path reads device values on the host (no ``.item()``,
``.tolist()``, ``.cpu()``); the forward must not either, and its launch grids may depend
only on shapes, never on the values of the inputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import numpy as np
import torch

from model_shards.backends.future_tokens import read_future_tokens_

log = logging.getLogger(__name__)

_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
_BUCKET_STEP = 16
_INT_FIELDS = 4  # token_ids, positions, slot_mapping, context_lens; then the tables


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, 32, then every 16 (48, 64, ...), none
    above ``max_num_seqs`` and ``max_num_seqs`` itself always last."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    buckets = [b for b in _SMALL_BUCKETS if b <= max_num_seqs]
    buckets += range(_SMALL_BUCKETS[-1] + _BUCKET_STEP, max_num_seqs + 1, _BUCKET_STEP)
    if buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return buckets


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest of the ascending ``buckets`` holding ``batch`` rows; ``None`` when
    ``batch`` exceeds them all (the step runs eagerly)."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one row, got {batch}")
    for b in buckets:
        if b >= batch:
            return b
    return None


@dataclass(frozen=True)
class DecodeStep:
    """One decode-only step as the scheduler holds it: Python ints, ``B`` rows.

    ``block_tables`` rows may be ragged (each at most the static width);
    ``token_ids`` on stage 0, ``hidden`` (a device tensor) on later stages."""

    positions: Sequence[int]  # [B]
    slot_mapping: Sequence[int]  # [B]
    block_tables: Sequence[Sequence[int]]  # [B][<= nblk]
    context_lens: Sequence[int]  # [B], the new token included
    token_ids: Sequence[int] | None = None  # [B]
    hidden: torch.Tensor | None = None  # [B, H]
    # the previous step's sampled ids [S] on the device: token ids < 0 read from it
    future_source: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class DecodeInputs:
    """The device tensors a decode forward reads (static views under a graph)."""

    token_ids: torch.Tensor  # [n] int64 (zeros on later stages)
    positions: torch.Tensor  # [n] int64
    slot_mapping: torch.Tensor  # [n] int64, -1 for padding
    block_tables: torch.Tensor  # [n, nblk] int64
    context_lens: torch.Tensor  # [n] int64, 0 for padding
    hidden: torch.Tensor | None  # [n, H] on later pipeline stages
    context_bound: int | None = None  # host-side bound of context_lens; None: the forward's


DecodeForward = Callable[[DecodeInputs], torch.Tensor]


def packed_size(rows: int, width: int) -> int:
    """Length of the packed int64 inputs of ``rows`` rows with ``width``-wide tables."""
    return rows * (_INT_FIELDS + width)


def _check_step(step: DecodeStep, rows: int, width: int) -> None:
    b = step.num_rows
    lengths = {
        "slot_mapping": len(step.slot_mapping),
        "block_tables": len(step.block_tables),
        "context_lens": len(step.context_lens),
    }
    if step.token_ids is not None:
        lengths["token_ids"] = len(step.token_ids)
    if step.hidden is not None:
        lengths["hidden"] = int(step.hidden.shape[0])
    wrong = {k: v for k, v in lengths.items() if v != b}
    if wrong:
        raise ValueError(f"decode step of {b} positions has {wrong} rows")
    if b > rows:
        raise ValueError(f"decode step of {b} rows does not fit a bucket of {rows}")
    widest = max((len(t) for t in step.block_tables), default=0)
    if widest > width:
        raise ValueError(f"block table of {widest} blocks exceeds the static width {width}")


def pack_step(out: np.ndarray, rows: int, width: int, step: DecodeStep) -> None:
    """Write ``step`` into ``out[: packed_size(rows, width)]`` in the packed layout, rows
    ``B .. rows - 1`` and the table columns right of each row's blocks as padding."""
    _check_step(step, rows, width)
    b = step.num_rows
    tok, pos, slot, ctx = (out[i * rows : (i + 1) * rows] for i in range(_INT_FIELDS))
    tok[:b] = 0 if step.token_ids is None else step.token_ids
    pos[:b] = step.positions
    slot[:b] = step.slot_mapping
    ctx[:b] = step.context_lens
    tok[b:], pos[b:], slot[b:], ctx[b:] = 0, 0, -1, 0
    tables = out[_INT_FIELDS * rows : packed_size(rows, width)].reshape(rows, width)
    tables.fill(0)
    for r, table in enumerate(step.block_tables):
        tables[r, : len(table)] = table


def unpack_inputs(
    buf: torch.Tensor, rows: int, width: int, hidden: torch.Tensor | None
) -> DecodeInputs:
    """Contiguous views of the packed ``buf`` (see :func:`pack_step`)."""
    tok, pos, slot, ctx = (buf[i * rows : (i + 1) * rows] for i in range(_INT_FIELDS))
    tables = buf[_INT_FIELDS * rows : packed_size(rows, width)].view(rows, width)
    return DecodeInputs(tok, pos, slot, tables, ctx, hidden)


def eager_inputs(step: DecodeStep, device: torch.device) -> DecodeInputs:
    """Exact-size inputs of ``step`` (table width: its widest row), one host->device copy."""
    b = step.num_rows
    width = max((len(t) for t in step.block_tables), default=0)
    host = np.empty(packed_size(b, width), dtype=np.int64)
    pack_step(host, b, width, step)
    inputs = unpack_inputs(torch.from_numpy(host).to(device), b, width, step.hidden)
    _read_futures(inputs, step)
    return replace(inputs, context_bound=max(step.context_lens, default=0))


def _read_futures(inputs: DecodeInputs, step: DecodeStep) -> None:
    """Async scheduling: ``step``'s future token ids replaced in ``inputs`` on the device."""
    if step.future_source is not None:
        read_future_tokens_(inputs.token_ids[: step.num_rows], step.future_source)


class StaticDecodeInputs:
    """The static device buffers of the largest bucket; :meth:`fill` writes a step into
    them, :meth:`views` gives what the graph of a bucket reads.

    ``pin_memory`` (default: the device is CUDA) pins and double-buffers the host staging
    and fences each copy with an event; decided here, once."""

    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        device: torch.device,
        hidden_size: int | None = None,
        hidden_dtype: torch.dtype = torch.bfloat16,
        pin_memory: bool | None = None,
    ) -> None:
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"max_rows and max_blocks must be >= 1: {max_rows}, {max_blocks}")
        self.max_rows, self.max_blocks, self.device = max_rows, max_blocks, device
        pin = device.type == "cuda" if pin_memory is None else pin_memory
        size = packed_size(max_rows, max_blocks)
        self._device_buf = torch.zeros(size, dtype=torch.int64, device=device)
        self._host = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(1 + pin)]
        self._host_np = [h.numpy() for h in self._host]
        self._fences = [torch.cuda.Event() for _ in self._host] if pin else []
        self._turn = 0
        self.hidden: torch.Tensor | None = None  # [max_rows, H]
        if hidden_size is not None:
            self.hidden = torch.zeros(max_rows, hidden_size, dtype=hidden_dtype, device=device)
        self.h2d_copies = 0  # host->device copies made by fill, for tests and metrics

    def views(self, rows: int) -> DecodeInputs:
        """What the graph of bucket ``rows`` reads: views of the device buffers."""
        hidden = None if self.hidden is None else self.hidden[:rows]
        return unpack_inputs(self._device_buf, rows, self.max_blocks, hidden)

    def fill(self, rows: int, step: DecodeStep) -> DecodeInputs:
        """Copy ``step``'s rows into the buffers of bucket ``rows`` and pad the rest."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"bucket {rows} outside 1 .. {self.max_rows}")
        if (self.hidden is None) != (step.hidden is None):
            need = "no hidden" if self.hidden is None else "hidden [B, H]"
            raise ValueError(f"this stage's decode step takes {need}")
        turn = self._turn
        if self._fences:
            self._fences[turn].synchronize()  # the copy that last read this staging buffer
            self._turn = 1 - turn
        pack_step(self._host_np[turn], rows, self.max_blocks, step)
        size = packed_size(rows, self.max_blocks)
        self._device_buf[:size].copy_(self._host[turn][:size], non_blocking=True)
        if self._fences:
            self._fences[turn].record()
        self.h2d_copies += 1
        if self.hidden is not None and step.hidden is not None:
            b = step.num_rows
            self.hidden[:b].copy_(step.hidden)  # device to device
            self.hidden[b:rows].zero_()
        inputs = self.views(rows)
        _read_futures(inputs, step)
        return inputs

    def fill_padding(self, rows: int) -> DecodeInputs:
        """Every row of bucket ``rows`` padding (what a capture runs on: no K/V stored)."""
        hidden = None if self.hidden is None else self.hidden[:0]
        return self.fill(rows, DecodeStep([], [], [], [], [], hidden))


@dataclass
class CapturedGraph:
    """A captured forward: ``output`` is its static output, rewritten by each replay."""

    fn: Callable[[], torch.Tensor]
    output: torch.Tensor  # [n, ...]
    graph: torch.cuda.CUDAGraph | None = None


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph: ...

    def replay(self, handle: CapturedGraph) -> torch.Tensor: ...


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` capture: warm-up runs on a side stream (Triton compiles,
    the allocator settles), then capture on that same stream into one memory pool shared
    by every graph (capture the largest batch first: the smaller ones reuse its memory)."""

    def __init__(self, warmup_runs: int = 2) -> None:
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = fn()
        torch.cuda.synchronize()
        return CapturedGraph(fn, output, graph)

    def replay(self, handle: CapturedGraph) -> torch.Tensor:
        if handle.graph is None:
            raise ValueError("not a CUDA graph capture")
        handle.graph.replay()
        return handle.output


ContextBounds = Callable[[int], Sequence[int]]  # bucket rows -> ascending context bounds


class GraphRunner:
    """Decode-only steps through captured graphs, one per bucket (and, with
    ``context_bounds``, per context bound of the bucket); eager when none fits.

    ``forward(inputs) -> [n, ...]`` is the model's decode pass; it must read its inputs
    only from ``inputs`` (the static views under a graph) and sync nothing to the host;
    ``inputs.context_bound`` is the graph's bound (``None`` without ``context_bounds``), a
    replay's longest context at most that. A step replays the graph of its bucket with the
    smallest bound holding its longest context. The tensor :meth:`run` returns is a view of
    a graph's static output: the next run may overwrite it, so consume (or clone) it first,
    on the same stream."""

    def __init__(
        self,
        forward: DecodeForward,
        static: StaticDecodeInputs,
        buckets: Sequence[int],
        graph_backend: GraphBackend,
        enforce_eager: bool = False,
        context_bounds: ContextBounds | None = None,
    ) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct, ascending and >= 1: {list(buckets)}")
        if buckets[-1] > static.max_rows:
            raise ValueError(
                f"bucket {buckets[-1]} exceeds the static buffers' {static.max_rows} rows"
            )
        self.forward, self.static, self.backend = forward, static, graph_backend
        self.buckets = list(buckets)
        self.enforce_eager = enforce_eager
        self.context_bounds = context_bounds
        self._graphs: dict[tuple[int, int | None], CapturedGraph] = {}
        self._bounds: dict[int, list[int | None]] = {}  # per bucket, ascending
        self._captured: list[int] = []  # ascending

    def capture_all(self) -> float:
        """Capture every bucket, largest first; the seconds it took (0 under enforce_eager)."""
        if self.enforce_eager:
            log.info("CUDA graphs disabled (enforce_eager): decode steps run eagerly")
            return 0.0
        start = time.perf_counter()
        self._graphs.clear()
        for n in reversed(self.buckets):
            bounds: list[int | None] = [None]
            if self.context_bounds is not None:
                bounds = list(self.context_bounds(n))
            self._bounds[n] = bounds
            for bound in bounds:
                inputs = replace(self.static.fill_padding(n), context_bound=bound)
                self._graphs[n, bound] = self.backend.capture(partial(self.forward, inputs))
        self._captured = list(self.buckets)
        seconds = time.perf_counter() - start
        log.info(
            "captured %d CUDA graphs (batch %s) in %.1f s",
            len(self._graphs),
            ", ".join(f"{n}" + _bounds_note(self._bounds[n]) for n in self._captured),
            seconds,
        )
        return seconds

    def graph_key(self, step: DecodeStep) -> tuple[int, int | None] | None:
        """``(bucket, context bound)`` of the graph ``step`` replays; ``None``: eager."""
        n = bucket_for(step.num_rows, self._captured)
        if n is None:
            return None
        longest = max(step.context_lens, default=0)
        bounds = self._bounds[n]
        return n, next((b for b in bounds if b is None or b >= longest), bounds[-1])

    def graph_for(self, step: DecodeStep) -> CapturedGraph | None:
        """The graph ``step`` would replay (``None``: it runs eagerly), for timing it alone."""
        key = self.graph_key(step)
        return None if key is None else self._graphs[key]

    def run(self, step: DecodeStep) -> torch.Tensor:
        """``forward`` on ``step``'s ``B`` rows → ``[B, ...]``, replayed when a bucket fits."""
        key = self.graph_key(step)
        if key is None:
            return self.forward(eager_inputs(step, self.static.device))
        self.static.fill(key[0], step)
        return self.backend.replay(self._graphs[key])[: step.num_rows]


def _bounds_note(bounds: Sequence[int | None]) -> str:
    """`` (contexts 1024/8192)`` for a bucket of several context bounds, else ``""``."""
    return "" if len(bounds) < 2 else f" (contexts {'/'.join(map(str, bounds))})"
