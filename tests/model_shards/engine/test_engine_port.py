"""A live ``shardserve engine`` port under abuse (one engine for the module, tiny Llama, tp 1).

* its listening sockets (engine port, torchrun's rendezvous, the world's store) are bound to
  127.0.0.1, none to every interface;
* 200 seeded random, truncated, wrongly typed and multi-frame frames, plus one over the frame
  limit, are dropped (counted in the engine stats, the sender told) and a request completes;
* requests with out-of-range stop / bad-words ids (or a NaN penalty, an empty allowed list)
  are refused alone, the others in the same batch complete;
* a connection without the token gets nothing done: its submit, its abort of another's
  request, its ``Shutdown`` are refused; so are ROUTER-assigned ids; an authenticated peer
  cannot abort another peer's request either; ``shardserve ping`` needs the token.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import msgspec
import psutil
import pytest
import zmq

from model_shards.messages import (
    AbortRequests,
    EmbedRequest,
    EngineError,
    EngineReady,
    GenerateRequest,
    SamplingParams,
    Shutdown,
    StepOutputs,
    SubmitBatch,
    SubmitEmbeddings,
    encode,
)
from server.cli.serve import main as cli
from tests.checkpoints import LLAMA_VOCAB_SIZE
from tests.model_shards.engine.engine_peer import LiveEngine, Peer, live_engine

pytestmark = pytest.mark.timeout(300)

MAX_MESSAGE = 1 << 20  # the engine's frame limit here ($SHARDSERVE_ENGINE_MAX_MESSAGE_BYTES)
GREEDY = SamplingParams(temperature=0.0)


def _request(
    rid: str, max_tokens: int = 4, sampling: SamplingParams = GREEDY, stop: list[int] | None = None
) -> GenerateRequest:
    prompt = [5, 17, 300, 42]
    return GenerateRequest(rid, prompt, max_tokens, sampling, stop or [], ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveEngine]:
    env = {"SHARDSERVE_ENGINE_MAX_MESSAGE_BYTES": str(MAX_MESSAGE)}
    with live_engine(tmp_path_factory.mktemp("engine_port"), env) as live:
        yield live
        assert live.process.poll() is None, live.log()  # it survived every test


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _friend(ctx: zmq.Context[zmq.Socket[bytes]], engine: LiveEngine) -> Peer:
    peer = Peer(ctx, engine.address)
    assert isinstance(peer.hello(engine.token), EngineReady)
    return peer


def test_listening_sockets_are_bound_to_loopback(engine: LiveEngine) -> None:
    agent = psutil.Process(engine.process.pid)  # `shardserve engine` became torchrun
    processes = [agent, *agent.children(recursive=True)]
    listening = {
        (p.pid, c.laddr.ip, c.laddr.port)
        for p in processes
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert not [s for s in listening if s[1] in ("0.0.0.0", "::")], listening
    ports = {port: ip for _pid, ip, port in listening}
    assert ports.get(engine.port) == "127.0.0.1", listening  # --engine-host's default
    workers = [p for p in processes if "MASTER_PORT" in p.environ()]
    master_port = int(workers[0].environ()["MASTER_PORT"])
    assert ports.get(master_port) == "127.0.0.1", listening  # the world's store
    assert len(listening) >= 3  # and torchrun's rendezvous store, checked by the first assert


def _bad_frames(rng: random.Random, count: int) -> list[list[bytes]]:
    """Random bytes, truncated and type-confused messages, wrong frame counts."""
    good = encode(SubmitBatch([_request("fuzz-good")]))
    wrong = [
        b"not msgpack!!",  # the 13-byte frame
        encode(EngineReady(64, 10, [])),  # an engine → frontend message
        msgspec.msgpack.encode({"type": "submit", "requests": [{"request_id": 3}]}),
        msgspec.msgpack.encode({"type": "abort", "request_ids": "all"}),
        msgspec.msgpack.encode({"type": "hello", "token": 7}),
        msgspec.msgpack.encode([1, 2, 3]),
        b"",
    ]
    frames: list[list[bytes]] = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            frames.append([rng.randbytes(rng.randrange(1, 64))])
        elif kind == 1:
            frames.append([good[: rng.randrange(1, len(good))]])
        elif kind == 2:
            frames.append([rng.choice(wrong)])
        else:
            frames.append([rng.randbytes(8) for _ in range(rng.choice((0, 2, 3)))] or [good, good])
    return frames


def test_fuzzed_frames_are_dropped_and_the_engine_keeps_serving(
    engine: LiveEngine, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    friend, stranger, big = (_friend(ctx, engine), Peer(ctx, engine.address), _friend(ctx, engine))
    before = friend.run(_request("fuzz-before"))
    assert before[1] == "length" and friend.stats is not None
    rejected_before = friend.stats.rejected_messages
    frames = _bad_frames(random.Random(41), 200)
    for i, message in enumerate(frames):
        (friend if i % 2 else stranger).send(*message)
    big.send(b"\x00" * (MAX_MESSAGE + 1))  # libzmq drops that connection unread
    errors = [m for m in iter(lambda: friend.recv(5.0), None) if isinstance(m, EngineError)]
    assert len(errors) == 100 and all(e.request_id is None for e in errors)
    assert "refused the message" in errors[0].message
    assert friend.run(_request("fuzz-after")) == before  # greedy: the same tokens
    assert friend.stats.rejected_messages - rejected_before == len(frames)


def test_out_of_range_ids_fail_only_their_request(
    engine: LiveEngine, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    friend = _friend(ctx, engine)
    v = LLAMA_VOCAB_SIZE
    bad = {
        "stop": _request("ids-stop", 4, SamplingParams(min_tokens=2), stop=[v + 5]),
        "bad-words": _request("ids-bad-words", sampling=SamplingParams(bad_words_token_ids=[[v]])),
        "allowed": _request("ids-allowed", sampling=SamplingParams(allowed_token_ids=[])),
        "nan": _request("ids-nan", sampling=SamplingParams(presence_penalty=math.nan)),
        "prompt": GenerateRequest("ids-prompt", [1, -3], 4),
    }
    good = _request("ids-good", max_tokens=6)
    friend.send(encode(SubmitBatch([*bad.values(), good])))
    for name, request in bad.items():
        tokens, finish = friend.collect(request.request_id)
        assert finish.startswith("refused: ") and not tokens, (name, finish)
    tokens, finish = friend.collect("ids-good")
    assert finish == "length" and len(tokens) == 6


def test_a_stranger_gets_nothing_done(
    engine: LiveEngine, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    friend, other = _friend(ctx, engine), _friend(ctx, engine)
    stranger, assigned = Peer(ctx, engine.address), Peer(ctx, engine.address, assigned_id=True)
    refused = stranger.hello("wrong-token-wrong-token")
    assert isinstance(refused, EngineError) and "bad_token" in refused.message
    refused = assigned.hello(engine.token)  # the right token, from a ROUTER-assigned id
    assert isinstance(refused, EngineError) and "routing_id" in refused.message
    friend.send(encode(SubmitBatch([_request("mine", max_tokens=40)])))
    first = friend.recv()
    assert isinstance(first, StepOutputs) and first.outputs[0].request_id == "mine"  # running
    for peer in (stranger, other):
        peer.send(encode(AbortRequests(["mine"])))  # only its submitter may abort it
    stranger.send(encode(SubmitBatch([_request("theirs")])))
    stranger.send(encode(SubmitEmbeddings([EmbedRequest("e", [1, 2])])))
    for peer in (stranger, assigned):
        peer.send(encode(Shutdown()))
    tokens, finish = friend.collect("mine")
    assert finish == "length" and len(first.outputs[0].new_token_ids) + len(tokens) == 40
    answers = list(iter(lambda: stranger.recv(3.0), None))
    assert not [m for m in answers if isinstance(m, StepOutputs)]  # "theirs" never ran
    assert [("unauthenticated" in m.message) for m in answers] == [True] * 4, answers
    assert isinstance(assigned.recv(), EngineError)  # its Shutdown: refused too
    friend.send(encode(SubmitBatch([_request("stopped", max_tokens=40)])))
    friend.send(encode(AbortRequests(["stopped"])))
    assert friend.collect("stopped")[1] == "abort"  # the submitter's own abort works
    assert friend.run(_request("still-serving"))[1] == "length"


def test_ping_needs_the_token(engine: LiveEngine) -> None:
    assert cli(["ping", engine.address, "--engine-token", engine.token]) == 0
    assert cli(["ping", engine.address, "--engine-token", "x" * 32, "--timeout", "1"]) == 1
