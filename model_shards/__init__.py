"""Everything inside one replica's torch.distributed world: rank 0's engine, every rank's
worker, the model and its kernels.

* ``messages.py``: every message that crosses a process boundary (msgspec structs, one codec);
* ``config/``: what a replica serves (checkpoint shape, flags), frozen and validated, torch-free;
* ``launch/``: start and stop a replica's ranks; what runs inside a rank process;
* ``engine/``: rank 0: requests in over ZMQ, the scheduler, a plan per step, tokens back;
* ``worker/``: every rank: one step of its pipeline stage on a plan, its KV pool, the sampler;
* ``parallel/``: who a rank is, its process groups, the collectives, same-host transports;
* ``models/``: one module per architecture family, and the registry of served architectures;
* ``layers/``: the TP-sharded building blocks (linear, attention, MoE, norms, rotary);
* ``backends/``: one implementation of every model op: reference, cpu (C++), cuda (Triton);
* ``splitmix.py``: splitmix64, the one hash behind every seed and random draw (pure Python).

The frontend (``server/``) imports only ``messages``, ``splitmix`` and ``config`` (all
torch-free), and ``launch`` inside the functions that start replicas. One replica is
``tp * pp`` rank processes; data parallelism is several replicas behind the frontend's router.
"""
