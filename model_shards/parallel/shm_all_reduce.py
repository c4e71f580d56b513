"""TP all-reduce through POSIX shared memory, for CPU ranks of one host (gloo's latency, gone).

A decode step of a 30-layer model makes 60 all-reduces of small ``[T, H]``
tensors; gloo spends ~0.3 ms on each. When every rank of a TP group runs on
the same host, the group instead shares one memory segment and sums there.

Segment (one per TP group, made by TP rank 0, ``/dev/shm/shardserve_ar_<pid>_<random>``)::

    header   per TP rank r, one 128-byte line of int64: [seq_r, pid, start time, pid ns]
    data     2 slot sets (by call parity) x tp slots of ``slot_bytes`` each

Contract of :meth:`ShmAllReduce.all_reduce` (call number ``n = 1, 2, ...``, the
same sequence of calls on every rank of the group, like any collective):

1. copy my tensor into my slot of set ``n % 2``;
2. publish: ``seq_me = n`` (after the data, see memory ordering below);
3. wait until every peer's ``seq >= n`` (the one wait per call);
4. sum the ``tp`` slots of set ``n % 2`` **in TP-rank order** into my tensor,
   so every rank computes bitwise the same result (float32 and wider: in the
   dtype, left to right; float16/bfloat16: accumulated in float32, rounded
   once, which at tp=2 is exactly the dtype's own addition).

Why one wait suffices: set ``n % 2`` was last read during call ``n - 2``; a
peer reaches ``seq = n - 1`` only after finishing call ``n - 2``, and step 3
of call ``n - 1`` saw every peer at ``n - 1``, so no peer still reads the slot
we overwrite. A tensor too big for a slot, non-contiguous, or of another dtype
is refused (``False``) on every rank alike, since all of these are the same on
every rank of a valid all-reduce; the caller then uses gloo.

Memory ordering: x86-64 is TSO (stores are seen in program order, loads are
not reordered with older loads). The writer stores the data, then the flag,
as one aligned 8-byte store; a reader that sees the flag sees the data. Bulk
copies that use non-temporal stores (glibc ``memcpy`` of large blocks) end
with ``sfence``. Weakly ordered CPUs (ARM) would need fences we cannot issue
from Python, so the segment is used on Linux x86-64 only.

Failure: a peer that does not publish within ``timeout_s`` (the groups'
collective timeout) raises ``RuntimeError`` naming it; a peer whose process
has exited is noticed within about a second (its pid no longer names a live
process started when it published; checked only in the same pid namespace).
Either leaves the object broken (every later call raises): the group's state
is unknown.

Lifetime: the segment is unlinked as soon as every rank has mapped it, so
no file is left in ``/dev/shm`` however the processes end later; a segment
whose creator died during that short window is removed by the next group
created on the host. :meth:`close` unmaps.

Waiting: spin ~0.1 ms, ``sched_yield`` up to 5 ms, then 50 us sleeps; when the
rank's cores are filled (``SHARDSERVE_SPIN_US``, see :mod:`model_shards.launch.cpu_budget`)
spin that long, then sleep, which lets a preempted peer run here.

Off switch: ``SHARDSERVE_SHM_ALLREDUCE=0`` (also ``false``/``off``/``no``) keeps
gloo. It is also gloo when the TP ranks are on different hosts, on other
platforms, or when ``/dev/shm`` has no room for the segment.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import secrets
import struct
import sys
import time

import torch
import torch.distributed as dist

from model_shards.launch.cpu_budget import spin_budget_s
from model_shards.parallel.same_host import all_agree, all_on_one_host, switched_off

log = logging.getLogger(__name__)

ENV_VAR = "SHARDSERVE_SHM_ALLREDUCE"
DEFAULT_SLOT_BYTES = 4 << 20  # [2048, 576] bf16 fits; bigger prefill chunks use gloo
SHM_DIR = "/dev/shm"
NAME_PREFIX = "shardserve_ar_"
_NAME_LEN = 64  # bytes of the broadcast name buffer
_LINE = 128  # header bytes per rank: seq, pid, start time, pid ns; no false sharing
_Q_PER_LINE = _LINE // 8
_SPIN_POLLS = 2000  # busy polls (~0.1 ms) before yielding the CPU
_POLL_S = 50e-9  # one poll, for a spin budget given in time
_YIELD_S = 0.005  # then sched_yield until this long, then short sleeps
_LIVENESS_S = 1.0  # how often a waiting rank checks that the peer still exists
_SUM_IN_FLOAT32 = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float32, torch.float64, torch.int32, torch.int64, *_SUM_IN_FLOAT32)


def unsupported_reason() -> str | None:
    """Why this process cannot use the shared-memory all-reduce, or ``None`` if it can."""
    off = switched_off(ENV_VAR)
    if off is not None:
        return off
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"platform {sys.platform}/{platform.machine()} (needs Linux x86-64)"
    if not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not writable"
    return None


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), ``None`` if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _whoami() -> tuple[int, int, int]:
    """This process's pid, start time and pid namespace inode (0: unknown), for liveness checks."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    started = _start_time(os.getpid())
    return os.getpid(), started or 0, ns if started is not None else 0


def sweep_stale_segments() -> None:
    """Unlink segments left by a creator that died before unlinking them (pid no longer alive)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            pid = name[len(NAME_PREFIX) :].split("_", 1)[0]
            if name.startswith(NAME_PREFIX) and pid.isdigit() and _start_time(int(pid)) is None:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))


def _create_segment(size: int) -> tuple[str, mmap.mmap] | None:
    sweep_stale_segments()
    name = f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        log.warning("shm all-reduce: cannot create %s (%s); TP uses gloo", path, e)
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now, rather than SIGBUS on first touch
        return name, mmap.mmap(fd, size)
    except OSError as e:
        os.unlink(path)
        log.warning(
            "shm all-reduce: %s has no room for %.1f MiB (%s); TP uses gloo (raise the "
            "container's shm size)",
            SHM_DIR,
            size / 2**20,
            e,
        )
        return None
    finally:
        os.close(fd)


def _open_segment(name: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError as e:
        log.warning("shm all-reduce: cannot open %s (%s); TP uses gloo", name, e)
        return None
    try:
        if os.fstat(fd).st_size != size:
            log.warning("shm all-reduce: %s is not %d bytes; TP uses gloo", name, size)
            return None
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class ShmAllReduce:
    """One TP group's shared segment; :meth:`all_reduce` sums in place (protocol: module doc)."""

    def __init__(
        self,
        mm: mmap.mmap,
        name: str,
        ranks: list[int],
        index: int,
        slot_bytes: int,
        timeout_s: float,
    ) -> None:
        self.name = name  # already unlinked once every rank has mapped it
        self.ranks = ranks  # global ranks, in TP-rank order
        self.index = index  # my TP rank
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._mm: mmap.mmap | None = mm
        size = len(ranks)
        self._header = _header_bytes(size)
        self._flags = memoryview(mm)[: self._header].cast("q")
        with torch.inference_mode(False):  # views made later must be usable in and out of it
            self._buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._views: dict[tuple[torch.dtype, int, int], tuple[torch.Tensor, ...]] = {}
        self._peers = [r for r in range(size) if r != index]
        ids = [self._flags[r * _Q_PER_LINE + 1 : r * _Q_PER_LINE + 4].tolist() for r in range(size)]
        self._pids = [pid for pid, _, _ in ids]
        # A peer in another pid namespace is invisible: then only the timeout applies.
        self._started = {
            r: ids[r][1] if ids[r][2] != 0 and ids[r][2] == ids[index][2] else None
            for r in self._peers
        }
        self._seq = 0
        self._broken: str | None = None
        # Cores filled (cpu_budget's spin budget set): spin that long, then sleep at once,
        # so that a preempted peer can run on this core; else spin, yield 5 ms, sleep.
        budget = spin_budget_s()
        self._spin_polls = _SPIN_POLLS if budget is None else int(budget / _POLL_S)
        self._yield_s = _YIELD_S if budget is None else 0.0

    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup,
        ranks: list[int],
        index: int,
        timeout_s: float,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
    ) -> ShmAllReduce | None:
        """Set up the segment of the TP group ``ranks`` (every member calls this, collectively).

        Three collectives over ``group`` (gloo), tensors only: gather (willing,
        host id); broadcast of the name from ``ranks[0]``; all-reduce MIN of
        "mapped"; then each rank unlinks the name (the first one succeeds), so
        no file is left once any rank returns. Every member gets an instance,
        or every member gets ``None`` (use gloo).
        """
        size = len(ranks)
        if not all_on_one_host(unsupported_reason(), size, group, "TP all-reduce"):
            return None
        slot_bytes = -(-slot_bytes // 64) * 64
        total = _header_bytes(size) + 2 * size * slot_bytes
        name_buf = torch.zeros(_NAME_LEN, dtype=torch.uint8)
        made = _create_segment(total) if index == 0 else None
        if made is not None:
            name_buf[: len(made[0])] = torch.tensor(list(made[0].encode()), dtype=torch.uint8)
        dist.broadcast(name_buf, src=ranks[0], group=group)
        name = bytes(name_buf.tolist()).rstrip(b"\0").decode()
        mm = made[1] if made is not None else (_open_segment(name, total) if name else None)
        if mm is not None:
            at = index * _LINE + 8
            mm[at : at + 24] = struct.pack("=qqq", *_whoami())
        mapped = all_agree(mm is not None, group)  # also: every pid is written
        if name:  # every rank has mapped it (or given up): gone before anyone returns
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
        if not mapped:
            if mm is not None:
                mm.close()
            log.info("TP all-reduce over gloo: a rank could not map the shared segment")
            return None
        assert mm is not None
        log.info("TP all-reduce over shared memory: %d ranks, %d KiB slots", size, slot_bytes >> 10)
        return cls(mm, name, ranks, index, slot_bytes, timeout_s)

    @property
    def calls(self) -> int:
        """How many all-reduces went through the segment so far."""
        return self._seq

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum ``x`` over the group in place; ``False`` (nothing done) if ``x`` does not fit.

        ``False`` depends only on ``x``'s size, dtype, device and layout, which
        an all-reduce requires to be the same on every rank, so either every
        rank or no rank takes this path.
        """
        if self._broken is not None:
            raise RuntimeError(f"shm all-reduce unusable after an earlier failure: {self._broken}")
        nbytes = x.numel() * x.element_size()
        if (
            x.device.type != "cpu"
            or x.dtype not in _SUPPORTED
            or not x.is_contiguous()
            or nbytes > self.slot_bytes
        ):
            return False
        if nbytes == 0:
            return True
        seq = self._seq + 1
        slots = self._slot_views(x.dtype, x.numel(), seq & 1)
        flat = x.view(-1)
        slots[self.index].copy_(flat)
        self._flags[self.index * _Q_PER_LINE] = seq  # publish, after the data
        self._seq = seq
        self._wait(seq)
        if x.dtype in _SUM_IN_FLOAT32 and len(slots) > 2:
            acc = slots[0].float()
            for s in slots[1:]:
                acc.add_(s)
            flat.copy_(acc)
        else:
            torch.add(slots[0], slots[1], out=flat)
            for s in slots[2:]:
                flat.add_(s)
        return True

    def close(self) -> None:
        """Unmap the segment (idempotent); later calls raise."""
        if self._mm is None:
            return
        self._broken = "closed"
        self._views.clear()
        del self._buf
        self._flags.release()
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it dies
            self._mm.close()
        self._mm = None

    def _slot_views(self, dtype: torch.dtype, numel: int, parity: int) -> tuple[torch.Tensor, ...]:
        key = (dtype, numel, parity)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            size, nbytes = len(self.ranks), numel * dtype.itemsize
            with torch.inference_mode(False):
                views = tuple(
                    self._buf[start : start + nbytes].view(dtype)
                    for start in (
                        self._header + (parity * size + r) * self.slot_bytes for r in range(size)
                    )
                )
            self._views[key] = views
        return views

    def _wait(self, seq: int) -> None:
        flags, start = self._flags, 0.0
        for peer in self._peers:
            at = peer * _Q_PER_LINE
            if flags[at] < seq:
                for _ in range(self._spin_polls):
                    if flags[at] >= seq:
                        break
                else:
                    start = start or time.monotonic()  # one deadline for the whole call
                    self._wait_long(peer, seq, start)

    def _wait_long(self, peer: int, seq: int, start: float) -> None:
        flags, at = self._flags, peer * _Q_PER_LINE
        deadline, check = start + self.timeout_s, time.monotonic() + _LIVENESS_S
        while flags[at] < seq:
            now = time.monotonic()
            if now > deadline:
                self._fail(peer, seq, f"did not arrive within {self.timeout_s:g} s")
            if now > check:
                check = now + _LIVENESS_S
                started = self._started[peer]
                if started is not None and _start_time(self._pids[peer]) != started:
                    self._fail(peer, seq, "has exited")
            if now - start < self._yield_s:
                os.sched_yield()
            else:
                time.sleep(50e-6)

    def _fail(self, peer: int, seq: int, what: str) -> None:
        self._broken = (
            f"TP rank {peer} (global rank {self.ranks[peer]}, pid {self._pids[peer]}) {what} "
            f"at shm all-reduce #{seq}, waited for by TP rank {self.index}"
        )
        raise RuntimeError(self._broken)


def _header_bytes(size: int) -> int:
    return -(-size * _LINE // mmap.PAGESIZE) * mmap.PAGESIZE
