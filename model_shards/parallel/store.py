"""TCP stores that listen where they are told to (torch's listen on every interface).

``torch.distributed.TCPStore(host, port, is_master=True)`` binds its server to ``[::]`` and
``0.0.0.0`` whatever ``host`` says: a replica joined over ``tcp://127.0.0.1:PORT`` would
otherwise take rendezvous traffic from any host. :func:`bound_store` binds the listening
socket itself, to ``host``, and hands it to the store (``master_listen_fd``); a client is a
plain ``TCPStore``. Used for every world's store (:func:`~model_shards.parallel.state.
init_parallel`) and torchrun's rendezvous (:mod:`model_shards.launch.torchrun_agent`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (``port`` 0: a free one); ``OSError``
    when ``host`` is no address of this machine or the port is taken."""
    family, kind, proto, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def bound_store(
    host: str,
    port: int,
    *,
    is_server: bool,
    timeout: timedelta,
    world_size: int | None = None,
    multi_tenant: bool = False,
) -> dist.TCPStore:
    """The store at ``host:port``: its server (listening on ``host`` only; ``port`` 0 picks
    one, see ``.port``) when ``is_server``, else a client that connects within ``timeout``."""
    if not is_server:
        return dist.TCPStore(host, port, world_size, False, timeout, multi_tenant=multi_tenant)
    sock = listening_socket(host, port)
    port = int(sock.getsockname()[1])
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        wait_for_workers=False,
        multi_tenant=multi_tenant,
        master_listen_fd=sock.detach(),  # the store's server owns the descriptor from here
        use_libuv=True,
    )
