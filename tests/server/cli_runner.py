"""Run ``shardserve`` with a fake ``model_shards.launch.replicas`` (a FakeEngine thread per
"replica").

Used by test_cli.py as ``python -m tests.server.cli_runner serve ...``. Environment:

* ``FAKE_MODEL_DIR``: what the fake ``packaged_gguf()`` (the model without ``--model``) returns;
* ``FAKE_REPLICA_MODE``: ``ready`` (default), ``never_ready`` or ``dies`` (rank 1 exits
  with code 3 shortly after start);
* ``FAKE_REPLICA_RECORD``: a JSON file written by ``handle.stop()`` with what the
  fake engine saw (so the test knows the ranks were stopped and Shutdown sent).

Each fake replica writes ``fake replica: got Hello`` to stderr when the frontend's
``Hello`` reaches it (the frontend now waits for ``EngineReady``), for the test to
wait on.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

from model_shards.config.replica import ReplicaConfig
from model_shards.launch import packaged_model
from tests.server.fake_engine import FakeEngine

SHUTDOWN_WAIT_S = 5.0  # how long stop() waits for the Shutdown the frontend sends first


class FakeHandle:
    def __init__(self, config: ReplicaConfig) -> None:
        self.mode = os.environ.get("FAKE_REPLICA_MODE", "ready")
        self._dir = tempfile.mkdtemp(prefix="fake-replica-")
        self.address = f"ipc://{self._dir}/rank0.sock"
        self.engine = FakeEngine(
            self.address,
            vocab_size=400,
            eos_token_ids=[1],
            max_model_len=config.max_model_len or 256,
            special_ids={0},
            ready=self.mode == "ready",
            on_hello=_announce_hello,
        ).start()
        self.config = config
        self.started = time.monotonic()
        self.stopped = False

    def pids(self) -> list[int | None]:
        return [os.getpid(), None]

    def death(self) -> str | None:
        codes = self.exitcodes()
        dead = [rank for rank, code in enumerate(codes) if code is not None]
        return f"rank {dead[0]} exited with code {codes[dead[0]]}" if dead else None

    def respawn(self) -> FakeHandle:
        self._stop(expect_shutdown=False)  # a replica restarted for a dead rank gets none
        return FakeHandle(self.config)

    def is_alive(self) -> bool:
        return not self.stopped and all(code is None for code in self.exitcodes())

    def exitcodes(self) -> list[int | None]:
        if self.stopped:
            return [0, 0]
        if self.mode == "dies" and time.monotonic() - self.started > 0.5:
            return [None, 3]
        return [None, None]

    def stop(self, timeout: float = 10.0) -> None:
        self._stop(expect_shutdown=True)

    def _stop(self, expect_shutdown: bool) -> None:
        """Stop the fake engine (after the Shutdown the frontend sent, if one is expected)
        and write the record."""
        if self.stopped:
            return
        self.stopped = True
        if expect_shutdown:  # sent just before stop(); it may still be on its way
            engine = self.engine
            engine.wait_for(lambda: engine.shutdowns > 0, timeout=SHUTDOWN_WAIT_S)
            polls = engine.idle_polls  # then a poll finding nothing: what came after is counted
            engine.wait_for(lambda: engine.idle_polls > polls, timeout=SHUTDOWN_WAIT_S)
        self.engine.stop()
        record = {"stopped": True, "shutdowns": self.engine.shutdowns, "hellos": self.engine.hellos}
        Path(os.environ["FAKE_REPLICA_RECORD"]).write_text(json.dumps(record))


def _announce_hello() -> None:
    print("fake replica: got Hello", file=sys.stderr, flush=True)


def start_replica(config: ReplicaConfig, address: str | None = None) -> FakeHandle:
    config.validate()
    return FakeHandle(config)


def start_replicas(config: ReplicaConfig, dp: int = 1) -> list[FakeHandle]:
    config.validate()
    return [FakeHandle(config) for _ in range(dp)]


def packaged_gguf() -> Path:
    return Path(os.environ["FAKE_MODEL_DIR"])


def install_fakes() -> None:
    launch = types.ModuleType("model_shards.launch.replicas")
    launch.start_replica = start_replica  # type: ignore[attr-defined]
    launch.start_replicas = start_replicas  # type: ignore[attr-defined]
    sys.modules["model_shards.launch.replicas"] = launch
    packaged_model.packaged_gguf = packaged_gguf


if __name__ == "__main__":
    install_fakes()
    from server.cli.serve import main

    sys.exit(main(sys.argv[1:]))
