"""Process groups and collectives for one replica's world (TP inside a stage, PP across).

* ``state.py``: ``ParallelState``: who this rank is (global, TP, PP ranks) and its groups;
* ``comm.py``: ``Comm`` and every collective and point-to-point send the replica uses (through
  host memory where ranks share one GPU: ``SHARDSERVE_SHARED_GPU=1``, ``state.py``);
* ``store.py``: TCP stores whose server listens on the host given (torch's: every interface);
* ``transports.py``: the same-host transports of a CPU replica, opened after the groups;
* ``same_host.py``: what both fast paths share: the off switch, the host id, the agreement;
* ``shm_all_reduce.py``: TP all-reduce through one ``/dev/shm`` segment instead of gloo;
* ``local_links.py``: plans, activations and sampled tokens over Unix sockets instead of gloo.

Layers and models call :mod:`.comm`, never ``torch.distributed``; each primitive is a no-op at
group size 1, so a ``tp = pp = 1`` replica has no group at all. Tensors go over the default
group (NCCL on GPUs, else gloo), metadata (plans, sampled tokens) over a gloo CPU group, never
NCCL; where every rank is a CPU process of one host, the same-host transports replace gloo.
"""
