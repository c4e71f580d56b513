"""The replicas as the routes see them: one ``Engine``, however many replicas serve behind it.

* ``client.py``: ``EngineClient``: the connection to one replica's rank 0 (asyncio ZMQ DEALER);
* ``batcher.py``: requests arriving within ``--batch-window-ms`` sent as one ``SubmitBatch``;
* ``router.py``: ``Router``: each request to the replica with the fewest outstanding tokens;
* ``supervisor.py``: keep a spawned replica serving: notice a dead rank, restart, replay;
* ``stats.py``: engine counters from every replica summed into the ``/metrics`` gauges.

The routes always talk to a ``Router``, even over one replica. Behind it each replica is a
client (``--engine`` replicas, heartbeated) or a supervisor wrapping one (replicas this process
spawned): a request in flight when a rank dies is replayed with the tokens it already has, so
the caller sees one gap-free stream.
"""
