"""What the same-host fast paths (shared-memory all-reduce, local links) share: their
off switch, the host's identity, and the collective agreement to use them."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def switched_off(env_var: str) -> str | None:
    """``"VAR=value"`` when ``env_var`` turns the fast path off, else ``None`` (default on);
    ``ValueError`` naming the variable for a value that is neither on nor off."""
    value = os.environ.get(env_var, "1").strip().lower()
    if value in ("0", "false", "off", "no"):
        return f"{env_var}={value}"
    if value not in ("", "1", "true", "on", "yes"):
        raise ValueError(f"{env_var}={value!r}: use 1 (default) or 0 to keep gloo")
    return None


def host_id() -> int:
    """A stable 63-bit id of this host (hostname and kernel boot id), equal across processes."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    digest = hashlib.blake2b(f"{socket.gethostname()}/{boot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def all_on_one_host(
    reason: str | None, size: int, group: dist.ProcessGroup | None, what: str
) -> bool:
    """Collective over ``group`` (``size`` members): whether every member can take the fast
    path (its ``reason`` not to is ``None``) and all run on this host. Logs why not,
    as "``what`` over gloo: ..."; every member gets the same answer."""
    mine = torch.tensor([int(reason is None), host_id()], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    if not all(int(t[0]) for t in every):
        log.info("%s over gloo: %s", what, reason or "a peer cannot take the fast path")
        return False
    if len({int(t[1]) for t in every}) > 1:
        log.info("%s over gloo: the ranks are on different hosts", what)
        return False
    return True


def all_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Collective over ``group``: whether every member passed ``ok=True``."""
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(int(flag))
