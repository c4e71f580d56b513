"""``torchrun`` with its stores bound to the hosts they are told to use.

``python -m model_shards.launch.torchrun_agent ARGS`` is ``python -m torch.distributed.run
ARGS`` (the same elastic agent, flags and worker processes) plus one rendezvous backend,
``--rdzv-backend shardserve``: torch's ``c10d`` backend whose store, on the node that hosts it
(``--rdzv-conf is_host=1``), listens on the ``--rdzv-endpoint`` host only
(:func:`~model_shards.parallel.store.bound_store`; torch's own listens on every interface).
The agent does not share that store with its workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``):
they get ``MASTER_ADDR`` (the rank-0 agent's ``--local-addr``) and a fresh ``MASTER_PORT``, and
their rank 0 hosts the world's store there, bound to ``MASTER_ADDR``
(:func:`~model_shards.parallel.state.init_parallel`).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from model_shards.parallel.store import bound_store

BACKEND = "shardserve"
DEFAULT_RDZV_PORT = 29400  # torch's


class _BoundC10dBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state, under this backend's name."""

    @property
    def name(self) -> str:
        return BACKEND


def create_bound_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous over a store whose server (``is_host``) is bound to its host."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_RDZV_PORT)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    store = bound_store(
        host,
        port,
        is_server=bool(params.get_as_bool("is_host", False)),
        timeout=timedelta(seconds=read_timeout),
        multi_tenant=True,
    )
    return create_handler(store, _BoundC10dBackend(store, params.run_id), params)


def main(argv: list[str] | None = None) -> None:
    """Run torchrun's ``main`` with the ``shardserve`` backend registered."""
    from torch.distributed.run import main as torchrun_main

    rendezvous_handler_registry.register(BACKEND, create_bound_handler)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # workers host their own store
    torchrun_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
