"""Prompt logprobs on a real replica: scenarios rank 0 runs inside an engine test world, and
the check of what they returned against transformers' ``log_softmax`` of the same prompts.

Each scenario returns ``{request id: [prompt ids, top-N asked, scores]}``, ``scores`` the
request's ``RequestOutput.prompt_logprobs`` as lists (``None`` if it had none), JSON-ready for
the test process, which checks them with :func:`check_scores`.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import msgspec
import torch

from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.worker import prompt_logprobs
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import load_hf_model

Scored = dict[str, Any]

#: Long prompts: LM-head passes this small make a 512-token chunk take several.
LONG_PASS_ROWS = 100


def _request(rid: str, prompt: list[int], k: int | None, max_tokens: int = 3) -> GenerateRequest:
    sampling = SamplingParams(0.0)
    return GenerateRequest(rid, prompt, max_tokens, sampling, ignore_eos=True, prompt_logprobs=k)


def run_scored(coord: Coordinator, requests: list[GenerateRequest]) -> Scored:
    """Run ``requests`` together to the end; each one's prompt and prompt scores."""
    for req in requests:
        coord.add_request(req)
    scores: dict[str, Any] = {r.request_id: None for r in requests}
    seen = dict.fromkeys(scores, 0)
    while coord.has_work():
        for update in coord.pump():
            out = update.output
            seen[out.request_id] += out.prompt_logprobs is not None
            if out.prompt_logprobs is not None:
                scores[out.request_id] = msgspec.to_builtins(out.prompt_logprobs)
    coord.step()  # flush the last frees to the ranks
    assert coord.stats.num_free_blocks == coord.stats.num_blocks, "KV blocks leaked"
    assert all(n <= 1 for n in seen.values()), f"prompt scores sent more than once: {seen}"
    return {
        r.request_id: [r.prompt_token_ids, r.prompt_logprobs, scores[r.request_id]]
        for r in requests
    }


def chunked_and_cached(worker: Worker, max_len: int) -> dict[str, Any]:
    """Prompts split over several 16-token steps beside a request that scores nothing; then a
    prompt already in the prefix cache, scored in full (every token prefilled again)."""
    coord = Coordinator(worker, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=max_len)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(40)]
    out = run_scored(
        coord,
        [
            _request("c40", prompt, 5),
            _request("c13", prompt[:13], 0),
            _request("c1", prompt[:1], 2),
            _request("plain", prompt[5:25], None),
        ],
    )
    run_scored(coord, [_request("warm", prompt[:24], None)])
    before = coord.stats.prefill_tokens_computed
    out.update(run_scored(coord, [_request("hit", prompt[:24], 3)]))
    return {"scores": out, "hit_prefill": coord.stats.prefill_tokens_computed - before}


def preempted(coord: Coordinator) -> Scored:
    """Six scored prompts whose KV does not fit the pool together (preemptions)."""
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 1000) for _ in range(30)] for _ in range(6)]
    return run_scored(coord, [_request(f"p{i}", p, 2, 20) for i, p in enumerate(prompts)])


def long_prompt(worker: Worker, length: int, chunk: int) -> Scored:
    """One ``length``-token prompt, ``max_tokens`` 1, prefilled in ``chunk``-token steps and
    scored in passes of :data:`LONG_PASS_ROWS` rows (every rank must shrink the pass)."""
    coord = Coordinator(
        worker, max_num_seqs=2, max_num_batched_tokens=chunk, max_model_len=length + 8
    )
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(length)]
    return run_scored(coord, [_request("long", prompt, 1, 1)])


def shrink_passes(vocab_size: int) -> None:
    """Make each LM-head pass of prompt scoring :data:`LONG_PASS_ROWS` rows (on every rank)."""
    prompt_logprobs.LOGITS_ELEMENTS = LONG_PASS_ROWS * vocab_size


def check_scores(model_dir: Path, scored: Scored, atol: float = 3e-4) -> None:
    """Each request's scores against transformers on ``model_dir``: the prompt tokens' logprobs
    and the top alternatives' (ids and values) within ``atol``; ranks as counted there, up to
    near-ties; as many alternatives per token as asked. Requests that asked none got none."""
    for rid, (prompt, asked, got) in scored.items():
        assert (got is None) == (asked is None), f"{rid}: asked {asked}, got {got is not None}"
        if got is None:
            continue
        logp = _hf_logprobs(model_dir, tuple(prompt))  # [P - 1, V], row i scores token i + 1
        want = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        lps, ranks, top_ids, top_lps = got
        assert len(lps) == len(prompt) - 1, f"{rid}: {len(lps)} scores, prompt {len(prompt)}"
        if not lps:
            continue
        assert torch.allclose(torch.tensor(lps), want, atol=atol), f"{rid}: prompt logprobs differ"
        low = (logp > want[:, None] + atol).sum(-1) + 1
        high = (logp > want[:, None] - atol).sum(-1) + 1
        r = torch.tensor(ranks)
        assert bool(((low <= r) & (r <= high)).all()), f"{rid}: ranks differ"
        ids, values = torch.tensor(top_ids), torch.tensor(top_lps)
        k = ids.shape[1]
        assert k == asked, f"{rid}: {k} alternatives per token, asked {asked}"
        assert torch.allclose(values, logp.topk(k, -1).values, atol=atol), f"{rid}: top values"
        assert torch.allclose(logp.gather(1, ids), values, atol=atol), f"{rid}: top ids"


@functools.cache
def _hf_logprobs(model_dir: Path, prompt: tuple[int, ...]) -> torch.Tensor:
    """transformers' log-softmax after each prompt position but the last (kept: the layouts
    of one module score the same prompts)."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt], dtype=torch.long)).logits[0]
    return logits[:-1].float().log_softmax(-1)


@functools.cache
def _hf_model(model_dir: Path) -> torch.nn.Module:
    return load_hf_model(model_dir)
