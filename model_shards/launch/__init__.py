"""Starting replicas: the parent's side (validate, plan, spawn, stop) and what runs in a rank.

* ``replicas.py``: validate, plan data parallelism (GPUs, threads), spawn a replica's ranks, stop;
* ``cpu_budget.py``: usable cores (affinity, cgroup quota), threads per rank, OpenMP waiting;
* ``packaged_model.py``: the model served without ``--model``: the SmolLM2 GGUF of a wheel;
* ``default_model.py``: the tiny random Llama for tests and benchmarks (seeded, a real BPE);
* ``rank_process.py``: inside a rank: die with the parent, join the world, load, serve;
* ``cpu_governor.py``: inside a CPU rank: one thread fewer while other work takes its cores;
* ``torchrun.py``: ``shardserve engine``'s torchrun command, and each torchrun worker's entry;
* ``torchrun_agent.py``: torchrun itself plus a c10d rendezvous whose store binds its host;
* ``dp_attention.py``: ``--dp-attention``: its checks, one world of D replicas restarted together.

The CLI imports these only when it starts a replica. ``replicas.py`` initialises no CUDA, and
``rank_process.py`` imports torch and the rank's machinery inside its functions, after the
death signal and ``CUDA_VISIBLE_DEVICES`` are set. A spawned replica's ranks die with the
process that spawned them (``PR_SET_PDEATHSIG``); torchrun's are stopped by torchrun.
"""
