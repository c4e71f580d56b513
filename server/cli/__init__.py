"""The ``shardserve`` command line.

* ``__main__.py``: ``python -m server.cli``, the command without an installed entry point;
* ``serve.py``: ``shardserve serve``: validate, start the replicas, serve HTTP until stopped;
* ``run_batch.py``: ``shardserve run-batch``: an OpenAI batch file through an in-process app;
* ``startup.py``: what ``serve`` and ``run-batch`` share: start-up checks, spawning, the app;
* ``flag_checks.py``: the parsed flags as a ``ReplicaConfig``, and the combinations argparse
  cannot check (``--engine`` addresses, data parallel);
* ``args.py``: every subcommand's flags and their parsers;
* ``frontend_flags.py``: the tool-call and reasoning parser flags, run-batch's files (a leaf);
* ``flag_types.py``: argparse ``type=`` checks shared with the media flags (a leaf module);
* ``engine_token.py``: ``--engine-token``: its flag, its check, ``serve``'s token per run (a leaf);
* ``engine.py``: ``shardserve engine`` (a replica under torchrun, no frontend) and ``ping``;
* ``signals.py``: SIGINT/SIGTERM during ``serve``: raised as ``Stop``, held while spawning.

Imports run one way: ``serve`` may import ``run_batch``, ``engine``, ``startup``,
``flag_checks`` and ``args``,
each of those only the ones after it in that list (tests/server/test_imports.py). Nothing
is spawned before the flags, the replica config and the chat template pass their checks (a
mistake exits 2 saying why). torch comes in only with ``model_shards.launch``, imported when
replicas are started or the default model is needed; the load tester only for ``bench``.
"""
