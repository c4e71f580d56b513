"""Grammar-constrained decoding on a real replica (pp=2: the sampling rank is not rank 0).

One tp=1 × pp=2 world (overlapped micro-batches) runs, on rank 0's coordinator:

* json-schema, regex and EBNF requests, greedy and seeded: every output decodes to
  text the grammar accepts (checked in the parent with pydantic / ``re``), ending
  with EOS; the mask reached the last stage's sampler through the plan;
* free requests alone, then among constrained neighbours: identical outputs;
* the same constrained requests on a KV pool of a few blocks (preemptions happen):
  identical outputs;
* a constrained request resumed from its first tokens (the replay after a rank
  restart) continues with exactly the tokens of the uninterrupted run;
* logit_bias +100 on one id forces it; allowed_token_ids keeps the output inside;
* a grammar whose compile is held back stalls nobody: a free request submitted after
  it runs to the end meanwhile.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import pydantic
import pytest

from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, GrammarSpec, SamplingParams
from model_shards.parallel.comm import Comm
from server.text.tokenizer import Tokenizer
from tests.checkpoints import build_tiny_llama
from tests.model_shards.engine.engine_harness import MAX_LEN, build_worker, run_to_completion
from tests.world import run_world

pytestmark = pytest.mark.timeout(240)

SMALL_POOL = 16


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = pydantic.Field(max_length=6)
    count: int = pydantic.Field(ge=0, le=99)
    ok: bool


SCHEMA = json.dumps(Item.model_json_schema(), sort_keys=True, separators=(",", ":"))
REGEX = r"(cat|dog)s? [0-9]{1,3}"
EBNF = 'root ::= "yes" | "no" | "maybe"'
SLOW_REGEX = "(ab|cd){2,4}"
GRAMMARS = {
    "json": GrammarSpec("json_schema", SCHEMA),
    "regex": GrammarSpec("regex", REGEX),
    "ebnf": GrammarSpec("ebnf", EBNF),
}


def constrained_requests() -> list[GenerateRequest]:
    out = []
    for i, (name, spec) in enumerate(sorted(GRAMMARS.items()) * 2):
        sampling = SamplingParams(0.0) if i < 3 else SamplingParams(0.8, seed=7 + i)
        prompt = [5 + i, 40, 300 + i, 9, 17, 23, 31, 44, 52, 60 + i]
        out.append(GenerateRequest(f"{name}{i}", prompt, 40, sampling, grammar=spec))
    return out


def free_requests() -> list[GenerateRequest]:
    return [
        GenerateRequest(f"free{i}", [11 + i, 12, 13], 12, SamplingParams(0.0), ignore_eos=True)
        for i in range(3)
    ]


def _slow_compile(coord: Coordinator) -> dict[str, object]:
    """A grammar whose compile is held back: a free request submitted after it finishes
    meanwhile; released, the constrained one runs. Both outputs, and whether the free one
    finished while the compile was still held."""
    assert coord.constraints is not None
    cache = coord.constraints.cache
    release = threading.Event()
    load_one = cache._load

    def held(compiled: Future[str], future: Future[Any]) -> None:
        release.wait(60)
        load_one(compiled, future)

    cache._load = held  # type: ignore[method-assign]
    spec = GrammarSpec("regex", SLOW_REGEX)  # compiled by nobody before
    slow = GenerateRequest("slow", [9, 9, 9], 20, SamplingParams(0.0), grammar=spec)
    free = free_requests()[0]
    coord.add_request(slow)
    coord.add_request(free)
    out: dict[str, list[int]] = {"slow": [], free.request_id: []}
    free_done_while_held = False
    while coord.has_work():
        for update in coord.pump():
            out[update.output.request_id] += update.output.new_token_ids
            if update.output.finish_reason and update.output.request_id == free.request_id:
                free_done_while_held = not release.is_set() and not out["slow"]
                release.set()
    cache._load = load_one  # type: ignore[method-assign]
    return {"free_done_while_held": free_done_while_held, **out}


def _rank(peers: Comm, model_dir: str, out_path: str) -> None:
    results: dict[str, object] = {}
    for scenario in ("big", "small"):
        worker = build_worker(peers, model_dir, None if scenario == "big" else SMALL_POOL)
        if peers.ps.rank != 0:
            worker.serve_forever()
            continue
        coord = Coordinator(
            worker,
            max_num_seqs=32,
            max_num_batched_tokens=64,
            max_model_len=MAX_LEN,
            model_dir=model_dir,
        )
        if scenario == "big":
            results["free_alone"] = run_to_completion(coord, free_requests())
            mixed = run_to_completion(coord, free_requests() + constrained_requests())
            results["mixed"] = mixed
            first = constrained_requests()[4]  # seeded json
            resumed = msgspec.structs.replace(first, resume_output_ids=mixed[first.request_id][:5])
            results["resumed"] = run_to_completion(coord, [resumed])[first.request_id]
            bias = SamplingParams(0.0, logit_bias={77: 100.0})
            results["bias"] = run_to_completion(
                coord, [GenerateRequest("b", [5, 6], 4, bias, ignore_eos=True)]
            )
            allowed = SamplingParams(0.9, seed=3, allowed_token_ids=[20, 21, 22])
            req = GenerateRequest("a", [5, 6], 8, allowed, ignore_eos=True)
            results["allowed"] = run_to_completion(coord, [req])
            results["slow_compile"] = _slow_compile(coord)
        else:
            before = coord.stats.num_preemptions
            results["small"] = run_to_completion(coord, constrained_requests())
            results["preemptions"] = coord.stats.num_preemptions - before
        coord.shutdown()
    if peers.ps.rank == 0:
        Path(out_path).write_text(json.dumps(results))


def test_constrained_decoding_pp2(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=False)
    out = tmp_path / "out.json"
    run_world(_rank, 1, 2, str(model_dir), str(out), timeout=200)
    results = json.loads(out.read_text())
    tok = Tokenizer.from_dir(model_dir)
    mixed = results["mixed"]
    for req in constrained_requests():
        ids = mixed[req.request_id]
        assert ids[-1] == tok.eos_token_id, (req.request_id, ids)
        text = tok.decode(ids)
        kind = req.request_id.rstrip("0123456789")
        if kind == "json":
            Item.model_validate_json(text)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in ("yes", "no", "maybe"), text
    assert results["free_alone"] == {k: v for k, v in mixed.items() if k.startswith("free")}
    assert results["preemptions"] > 0
    assert results["small"] == {k: v for k, v in mixed.items() if not k.startswith("free")}
    assert results["resumed"] == mixed["json4"][5:]
    assert results["bias"]["b"] == [77] * 4
    assert set(results["allowed"]["a"]) <= {20, 21, 22}
    slow = results["slow_compile"]
    assert slow["free_done_while_held"], slow
    assert slow["free0"] == results["free_alone"]["free0"]
    assert re.fullmatch(SLOW_REGEX, tok.decode(slow["slow"])), slow
