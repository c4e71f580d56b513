"""How many KV blocks a rank's pool gets: its memory budget, agreed over the replica."""

from __future__ import annotations

import logging
import os

import torch

from model_shards.config import vision_budget
from model_shards.config.kv_layout import KVLayout, peak_blocks
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.models import DecoderModel
from model_shards.parallel.comm import Comm, all_reduce_min_int
from model_shards.worker import gpu_memory
from model_shards.worker.media_inputs import takes_images
from model_shards.worker.piecewise_graphs import MAX_TOKENS, PIECEWISE_ENV

log = logging.getLogger(__name__)

CPU_KV_CACHE_DEFAULT = 1 << 30  # bytes per rank when neither flag nor GPU says otherwise


def kv_cache_blocks(
    cfg: ModelConfig,
    replica: ReplicaConfig,
    comm: Comm,
    model: DecoderModel,
    dtype: torch.dtype,
    max_model_len: int,
    *,
    graphs: bool,
) -> int:
    """Blocks this rank's budget allows, agreed (minimum) over the replica, at most what
    ``max_num_seqs`` full-length sequences need; ``ValueError`` if too few for one. Budget:
    ``--kv-cache-memory``, else on GPU what :mod:`model_shards.worker.gpu_memory` leaves of
    ``--gpu-memory-utilization``, else 1 GiB."""
    ps = comm.ps
    layout = KVLayout.for_model(cfg)
    buffers = layout.slots_on(range(model.model.start, model.model.end))
    per_block = cfg.kv_block_bytes(ps.tp_size, buffers, replica.block_size, dtype.itemsize)
    if replica.kv_cache_memory is not None:
        budget = replica.kv_cache_memory
    elif ps.device.type == "cuda":
        budget = _gpu_kv_budget(replica, model, max_model_len, graphs)
    else:
        budget = CPU_KV_CACHE_DEFAULT
    chunk = replica.max_num_batched_tokens
    per_seq = peak_blocks(layout.windows, max_model_len, replica.block_size, chunk)
    blocks = min(max(budget, 0) // per_block, per_seq * replica.max_num_seqs)
    blocks = all_reduce_min_int(blocks, comm)
    if blocks < per_seq:
        raise ValueError(
            f"KV cache of {blocks} blocks cannot hold one {max_model_len}-token sequence; "
            f"raise --kv-cache-memory (or --gpu-memory-utilization) or lower --max-model-len"
        )
    return blocks


def _gpu_kv_budget(
    replica: ReplicaConfig, model: DecoderModel, max_model_len: int, graphs: bool
) -> int:
    bs, seqs = replica.block_size, replica.max_num_seqs
    tokens = replica.max_num_batched_tokens
    peak = gpu_memory.forward_peak_bytes(model, tokens, max_model_len, bs, seqs)
    vision = 0  # a VLM's first stage: the tower over the largest media of one step
    if takes_images(model, model.ps):
        caps = vision_budget.MediaCaps.from_dir(replica.model_dir)
        media = vision_budget.worst_case_media(model.config.extra, tokens, max_model_len, caps)
        vision = gpu_memory.vision_peak_bytes(model, media)
    peak = max(peak, vision)
    pool = gpu_memory.forward_peak_bytes(model, seqs, 1, bs, seqs) if graphs else 0
    if graphs and os.environ.get(PIECEWISE_ENV) == "1":  # their pool: 512 rows a step
        pool += gpu_memory.forward_peak_bytes(model, min(tokens, MAX_TOKENS), 1, bs, seqs)
    free, total = torch.cuda.mem_get_info(model.ps.device)
    budget = gpu_memory.kv_budget_bytes(
        replica.gpu_memory_utilization, total, total - free, peak, pool
    )
    if model.ps.host_tensors:  # every rank of the replica on this one GPU: a share each
        budget //= model.ps.world_size
    log.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use after loading, forward peak %.2f GiB "
        "(%d tokens; vision tower %.2f GiB), graph pool %.2f GiB: %.2f GiB for the KV cache",
        total / 2**30,
        (total - free) / 2**30,
        peak / 2**30,
        tokens,
        vision / 2**30,
        pool / 2**30,
        budget / 2**30,
    )
    return budget
