"""Point-to-point messages between the CPU ranks of one host, over Unix stream sockets.

With pipeline parallelism every micro-batch crosses ranks three times: its step
plan (rank 0 → every rank), its activations (stage → next stage) and its sampled
tokens (last stage → rank 0). Over gloo each message is a rendezvous: the
receiver announces its buffer, the sender's gloo thread answers, the receiver's
gloo thread reads, then wakes the caller. On cores busy with the stages' GEMMs
each of those wake-ups waits for a time slice, and the handoffs added ~10 ms to
every micro-batch. Here the sender's calling thread writes the message into the
kernel's socket buffer and the receiver's calling thread reads it: one wake-up.

Contract (:class:`LocalLinks`, one per rank, a full mesh of the replica's ranks):

* :meth:`send` never blocks the caller: what the socket buffer cannot take now
  waits in the link's outbox, which a helper thread writes out in order. So two
  ranks sending to each other at the same time cannot deadlock.
* Messages between two ranks arrive in the order they were sent (one stream per
  pair, both directions). A frame is an 8-byte little-endian length, then the
  payload; :meth:`recv_into` checks the length against its tensor.
* Receives wait up to ``timeout_s`` (the groups' collective timeout); a peer
  whose process ended closes its end, and the waiting rank raises at once,
  naming it. Any failure leaves the links broken (later calls raise).

Set-up (:meth:`LocalLinks.create`, collective over the CPU group): ranks on
different hosts, other platforms or ``SHARDSERVE_LOCAL_LINKS=0`` keep gloo (every
rank alike). Every rank listens on the abstract socket
``\\0shardserve-<token>-<rank>`` (the token broadcast by rank 0; nothing is left
on disk), connects to every lower rank and says who it is, then accepts the
higher ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from model_shards.parallel.same_host import all_agree, all_on_one_host, switched_off

log = logging.getLogger(__name__)

ENV_VAR = "SHARDSERVE_LOCAL_LINKS"
_HEADER = struct.Struct("<q")
_TOKEN_BYTES = 16
# Asked of the kernel for each socket's send buffer (it grants up to twice
# net.core.wmem_max): a prefill's activations then go out in one write, with no
# help from the writer thread, which must wait for the GIL between chunks.
_SEND_BUFFER_BYTES = 64 * 2**20


def unsupported_reason() -> str | None:
    """Why this process cannot use local links, or ``None`` if it can."""
    off = switched_off(ENV_VAR)
    if off is not None:
        return off
    if not sys.platform.startswith("linux"):
        return f"platform {sys.platform} (abstract Unix sockets need Linux)"
    return None


class _Link:
    """One peer: a socket object for reads (with the timeout) and one for non-blocking
    writes, on the same connection; an outbox and its writer thread for what did not fit."""

    def __init__(self, sock: socket.socket, peer: int, timeout_s: float) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        self.reader = sock
        self.reader.settimeout(timeout_s)
        self.writer = socket.socket(fileno=os.dup(sock.fileno()))
        self.writer.setblocking(False)
        with contextlib.suppress(OSError):
            self.writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
        self.lock = threading.Lock()
        self.outbox: deque[memoryview] = deque()
        self.wakeup = threading.Condition(self.lock)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.overflows = 0  # messages the socket buffer could not take whole

    def send(self, parts: list[memoryview]) -> None:
        with self.lock:
            if self.error is not None:
                raise RuntimeError(f"link to rank {self.peer} failed: {self.error}")
            if not self.outbox:
                try:
                    sent = self.writer.sendmsg(parts)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    raise RuntimeError(f"rank {self.peer} is gone ({e})") from e
                parts = _drop_front(parts, sent)
            if parts:
                self.overflows += 1
                self.outbox.extend(parts)
                self._start_writer()
                self.wakeup.notify()

    def _start_writer(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._write_out, name=f"link-{self.peer}", daemon=True
            )
            self.thread.start()

    def _write_out(self) -> None:
        """Writer thread: send the outbox in order, waiting for room as needed."""
        poll = select.poll()
        poll.register(self.writer, select.POLLOUT)
        while True:
            with self.lock:
                while not self.outbox:
                    self.wakeup.wait()
                part = self.outbox[0]
            try:
                if not poll.poll(self.timeout_s * 1000):
                    raise TimeoutError(f"rank {self.peer} took nothing for {self.timeout_s:g} s")
                sent = self.writer.send(part)
            except BlockingIOError:
                continue
            except OSError as e:
                with self.lock:
                    self.error = e
                    self.outbox.clear()
                    self.wakeup.notify_all()
                return
            with self.lock:
                if sent == len(part):
                    self.outbox.popleft()
                else:
                    self.outbox[0] = part[sent:]
                if not self.outbox:
                    self.wakeup.notify_all()

    def flush(self, timeout_s: float) -> None:
        """Wait until the outbox is written (or the link failed, or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.outbox and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.wakeup.wait(left)

    def recv_exact(self, view: memoryview) -> None:
        try:
            _read_exact(self.reader, view)
        except TimeoutError:
            raise RuntimeError(
                f"no message from rank {self.peer} within {self.timeout_s:g} s"
            ) from None
        except EOFError:
            raise RuntimeError(f"rank {self.peer} closed its link (its process ended?)") from None
        except OSError as e:
            raise RuntimeError(f"rank {self.peer} is gone ({e})") from e

    def recv_size(self) -> int:
        """The length of the next frame's payload."""
        header = bytearray(_HEADER.size)
        self.recv_exact(memoryview(header))
        return int(_HEADER.unpack(header)[0])

    def close(self) -> None:
        for sock in (self.writer, self.reader):
            with contextlib.suppress(OSError):
                sock.close()


def _read_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``EOFError`` if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError
        got += n


def _drop_front(parts: list[memoryview], count: int) -> list[memoryview]:
    """``parts`` without their first ``count`` bytes."""
    out = []
    for part in parts:
        if count >= len(part):
            count -= len(part)
            continue
        out.append(part[count:])
        count = 0
    return out


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().contiguous().view(torch.uint8).numpy().data.cast("B")


class LocalLinks:
    """A rank's links to every other rank of its replica (see the module docstring)."""

    def __init__(self, rank: int, links: dict[int, _Link]) -> None:
        self.rank = rank
        self._links = links
        self.messages_sent = 0

    @classmethod
    def create(
        cls, rank: int, world_size: int, group: dist.ProcessGroup | None, timeout_s: float
    ) -> LocalLinks | None:
        """Connect every rank of ``group`` (the whole replica) to every other, collectively.

        Every rank gets an instance, or every rank gets ``None`` (use gloo).
        """
        if not all_on_one_host(unsupported_reason(), world_size, group, "rank messages"):
            return None
        token = torch.tensor(list(secrets.token_bytes(_TOKEN_BYTES)), dtype=torch.uint8)
        dist.broadcast(token, src=0, group=group)
        prefix = b"\0shardserve-" + bytes(token.tolist()).hex().encode() + b"-"
        links: dict[int, _Link] = {}
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ok = True
        try:
            listener.bind(prefix + str(rank).encode())
            listener.listen(world_size)
        except OSError as e:
            log.info("rank messages over gloo: cannot listen (%s)", e)
            ok = False
        try:
            ok = all_agree(ok, group)
            if ok:
                ok = all_agree(_connect(prefix, rank, world_size, timeout_s, links), group)
            if ok:
                ok = all_agree(_accept(listener, rank, world_size, timeout_s, links), group)
        finally:
            listener.close()
        if not ok:
            for link in links.values():
                link.close()
            return None
        return cls(rank, links)

    def send(self, dst: int, data: bytes | torch.Tensor) -> None:
        """Queue one message to ``dst`` without blocking (``data`` is copied or kept alive)."""
        payload = memoryview(data).cast("B") if isinstance(data, bytes) else _bytes_of(data)
        header = memoryview(_HEADER.pack(len(payload)))
        self._links[dst].send([header, payload])
        self.messages_sent += 1

    @property
    def overflows(self) -> int:
        """Messages so far that the writer threads finished (bigger than a socket buffer)."""
        return sum(link.overflows for link in self._links.values())

    def recv_bytes(self, src: int) -> bytes:
        link = self._links[src]
        payload = bytearray(link.recv_size())
        link.recv_exact(memoryview(payload))
        return bytes(payload)

    def recv_into(self, src: int, out: torch.Tensor) -> torch.Tensor:
        """Receive one message from ``src`` into the contiguous CPU tensor ``out``."""
        link = self._links[src]
        size = link.recv_size()
        if size != out.numel() * out.element_size():
            raise RuntimeError(
                f"rank {src} sent {size} bytes where {tuple(out.shape)} {out.dtype} was expected"
            )
        link.recv_exact(_bytes_of(out))
        return out

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Write out what is queued (up to ``flush_timeout_s``), then close every link."""
        for link in self._links.values():
            link.flush(flush_timeout_s)
        for link in self._links.values():
            link.close()


def _connect(
    prefix: bytes, rank: int, world_size: int, timeout_s: float, links: dict[int, _Link]
) -> bool:
    for peer in range(rank):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(prefix + str(peer).encode())
            sock.sendall(_HEADER.pack(rank))
        except OSError as e:
            sock.close()
            log.info("rank messages over gloo: cannot reach rank %d (%s)", peer, e)
            return False
        links[peer] = _Link(sock, peer, timeout_s)
    return True


def _accept(
    listener: socket.socket, rank: int, world_size: int, timeout_s: float, links: dict[int, _Link]
) -> bool:
    listener.settimeout(timeout_s)
    for _ in range(rank + 1, world_size):
        try:
            sock, _ = listener.accept()
            sock.settimeout(timeout_s)
            hello = bytearray(_HEADER.size)
            _read_exact(sock, memoryview(hello))
        except EOFError:
            log.info("rank messages over gloo: a peer closed before saying who it is")
            return False
        except OSError as e:
            log.info("rank messages over gloo: a peer did not connect (%s)", e)
            return False
        (peer,) = _HEADER.unpack(hello)
        links[peer] = _Link(sock, peer, timeout_s)
    return True
