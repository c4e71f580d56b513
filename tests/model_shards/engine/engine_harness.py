"""A tiny Llama replica's rank-0 engine for tests: build a rank's worker, run requests to
completion (every KV block free again afterwards)."""

from __future__ import annotations

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker, resolve_dtype

BLOCK = 4


MAX_LEN = 64


def run_to_completion(coord: Coordinator, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    for req in requests:
        coord.add_request(req)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while coord.has_work():
        for update in coord.pump():
            out[update.output.request_id] += update.output.new_token_ids
    coord.step()  # flush the last frees to the ranks
    stats = coord.stats
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return out


def build_worker(peers: Comm, model_dir: str, blocks: int | None, max_len: int = MAX_LEN) -> Worker:
    ps = peers.ps
    cfg = ModelConfig.from_dir(model_dir)
    memory = None
    if blocks is not None:
        itemsize = resolve_dtype("float32", cfg).itemsize
        per_block = cfg.kv_block_bytes(ps.tp_size, cfg.num_layers // ps.pp_size, BLOCK, itemsize)
        memory = blocks * per_block
    replica = ReplicaConfig(
        model_dir, dtype="float32", block_size=BLOCK, max_num_seqs=32, kv_cache_memory=memory
    )
    return Worker.build(replica, cfg, peers, max_len)
