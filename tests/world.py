"""Spawn a gloo world of ``n`` CPU processes for a test, with a hard timeout and cleanup.

``run_world(fn, tp, pp, *args)`` runs ``fn(comm, *args)`` on every rank after
:func:`init_parallel` and :meth:`Comm.open` (``comm.ps`` is the rank's
:class:`ParallelState`); ``fn`` must be a module-level function. Any rank failing
or the deadline passing kills every rank and fails the test; no process is
left behind either way.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from model_shards.launch.replicas import free_port
from model_shards.parallel.state import SHARED_GPU_ENV, ParallelState

# ``make gpu-check`` runs the multi-rank tests on GPUs: SHARDSERVE_TEST_DEVICE=cuda (and
# with SHARDSERVE_SHARED_GPU=1 several ranks on one GPU, tensors over gloo)
TEST_DEVICE = os.environ.get("SHARDSERVE_TEST_DEVICE", "cpu")


def _entry(
    fn: Callable[..., None], rank: int, tp: int, pp: int, port: int, args: tuple[Any, ...]
) -> None:
    import torch

    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import destroy_parallel, init_parallel

    faulthandler.enable()  # a native abort still shows where Python was
    torch.set_num_threads(1)
    try:
        ps = init_parallel(
            rank,
            tp,
            pp,
            master_addr="127.0.0.1",
            master_port=port,
            device=TEST_DEVICE,
            timeout_s=60,
            cuda_index=rank,
        )
        peers = Comm.open(ps)
        fn(peers, *args)
        destroy_parallel(ps, peers.close)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    # The rank's work is done and checked; skip interpreter teardown, where gloo's
    # background threads have (rarely, under load) aborted the process after success.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(fn: Callable[..., None], tp: int, pp: int, *args: Any, timeout: float = 120) -> None:
    if TEST_DEVICE == "cuda":
        import torch

        shared = os.environ.get(SHARED_GPU_ENV) == "1"  # every rank on cuda:0, gloo
        if torch.cuda.device_count() < tp * pp and not shared:
            pytest.skip(f"tp={tp} pp={pp} needs {tp * pp} GPUs (NCCL: one per rank)")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, tp, pp, port, args), daemon=True)
        for rank in range(tp * pp)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"world tp={tp} pp={pp} did not finish in {timeout}s")
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank failed: the others may wait forever on it
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            raise RuntimeError(f"world tp={tp} pp={pp}: rank exit codes {codes}")
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


__all__ = ["ParallelState", "run_world"]
