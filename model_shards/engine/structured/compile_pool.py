"""Grammar compiles in worker processes, each with a deadline: one that runs past it is killed.

:class:`CompilePool` keeps ``workers`` compile processes
(:mod:`model_shards.engine.structured.compile_worker`), all started with the first job (a
compile then never waits for a start-up behind another compile), each driven by one thread
of rank 0. A job's deadline (``timeout_s``) counts from the moment its worker has it; a
worker past it is killed (``xgrammar`` cannot interrupt a compile) and a fresh one started
for the next job, and the job fails with a :class:`GrammarError` (``grammar_timeout``). So a
grammar that compiles for ever holds one worker for ``timeout_s``, never the others.
"""

from __future__ import annotations

import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from model_shards.messages import CompiledGrammar, GrammarSpec, decode_compiled_grammar, encode

#: Compiles at once, and how long one may take.
COMPILE_WORKERS = 2
COMPILE_TIMEOUT_S = 10.0
#: How long a worker may take to start (import xgrammar, read the vocabulary).
START_TIMEOUT_S = 300.0

_LENGTH = struct.Struct(">I")
_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding model_shards/


class GrammarError(ValueError):
    """Why a request's grammar cannot be used; ``code`` (an ``EngineError.code``) says which
    kind: ``grammar_invalid``, ``grammar_timeout`` (compile), ``grammar_too_slow`` (masks)."""

    def __init__(self, message: str, code: str = "grammar_invalid") -> None:
        super().__init__(message)
        self.code = code


class _Worker:
    """One compile process and the bytes read from it so far."""

    def __init__(self, argv: list[str]) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "model_shards.engine.structured.compile_worker", *argv]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._buffer = b""

    def ask(self, spec: GrammarSpec | None, timeout_s: float) -> CompiledGrammar:
        """Send ``spec`` (``None``: only read, e.g. the ready message); its answer, or
        ``TimeoutError``; ``EOFError`` if the worker died."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        if spec is not None:
            payload = encode(spec)
            stdin.write(_LENGTH.pack(len(payload)) + payload)
            stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._buffer)
                end = _LENGTH.size + length
                if len(self._buffer) >= end:
                    frame, self._buffer = self._buffer[_LENGTH.size : end], self._buffer[end:]
                    return decode_compiled_grammar(frame)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stdout], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(stdout.fileno(), 1 << 20)
            if not chunk:
                raise EOFError("the grammar compile worker exited")
            self._buffer += chunk

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class CompilePool:
    """Compiles :class:`GrammarSpec` values in worker processes (see the module docstring);
    each result is ``xgrammar``'s serialized compiled grammar (JSON)."""

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        workers: int = COMPILE_WORKERS,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self._argv = [str(model_dir), str(vocab_size), *map(str, eos_token_ids)]
        self._jobs: queue.SimpleQueue[tuple[GrammarSpec, Future[str]] | None] = queue.SimpleQueue()
        self._workers = workers
        self.timeout_s = timeout_s
        self._threads: list[threading.Thread] = []
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None  # why a worker cannot start (no tokenizer.json, ...)

    def submit(self, spec: GrammarSpec) -> Future[str]:
        future: Future[str] = Future()
        with self._lock:
            while len(self._threads) < self._workers:
                thread = threading.Thread(target=self._drive, name="grammar-compile", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._jobs.put((spec, future))
        return future

    def close(self) -> None:
        """Kill every worker (a compile in progress ends with it)."""
        for _ in self._threads:
            self._jobs.put(None)
        with self._lock:
            self._closed = True
            for worker in self._live:
                worker.kill()
            self._live.clear()

    def _start(self) -> _Worker:
        with self._lock:
            if self._closed or self._broken is not None:
                raise GrammarError(self._broken or "the engine is shutting down")
            worker = _Worker(self._argv)
            self._live.add(worker)
        try:
            ready = worker.ask(None, START_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            self._kill(worker)
            raise GrammarError(f"the grammar compile worker did not start ({exc!r})") from exc
        if ready.error is not None:
            self._kill(worker)
            self._broken = ready.error  # the same for every worker: answer at once from now
            raise GrammarError(ready.error)
        return worker

    def _restart(self) -> _Worker | None:
        """A fresh worker, started now (``None`` if it will not start: the next job says why)."""
        try:
            return self._start()
        except GrammarError:
            return None

    def _kill(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.kill()

    def _drive(self) -> None:
        """One worker's thread: start it, hand it jobs, kill it past a deadline."""
        worker: _Worker | None = None
        while (job := self._jobs.get()) is not None:
            spec, future = job
            try:
                worker = worker or self._start()
                answer = worker.ask(spec, self.timeout_s)
            except GrammarError as exc:
                future.set_exception(exc)
                continue
            except TimeoutError:
                message = f"the {spec.kind} grammar did not compile within {self.timeout_s:g} s"
                future.set_exception(GrammarError(message, "grammar_timeout"))
            except (EOFError, OSError) as exc:
                future.set_exception(GrammarError(f"the grammar compile failed: {exc}"))
            else:
                if answer.error is None:
                    future.set_result(answer.serialized)
                else:
                    future.set_exception(GrammarError(answer.error))
                continue
            if worker is not None:  # timed out or broken: a fresh worker for the next job
                self._kill(worker)
            worker = self._restart()
        if worker is not None:
            self._kill(worker)
