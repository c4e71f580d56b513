"""Every rank's step executor: run this stage of the model on a :class:`StepPlan`.

Data flow of one step (the same plan on every rank):

1. free the KV cache of finished sequences; the sampling rank registers new ones;
2. first stage embeds the plan's token ids, later stages receive the previous
   stage's hidden states ``[T, H]``;
3. run this stage's layers (TP all-reduces inside);
4. non-last stages send ``[T, H]`` on; the last stage computes logits for each
   chunk's final token, its TP rank 0 samples, and sends the tokens (and, when
   asked, the logits) to global rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from model_shards.checkpoint import Checkpoint
from model_shards.config import ModelConfig
from model_shards.kv_cache import KVCache
from model_shards.layers.attention import ForwardBatch
from model_shards.loader import load_weights
from model_shards.messages import StepPlan, decode_plan, encode
from model_shards.models import MODEL_REGISTRY
from model_shards.models.llama import LlamaForCausalLM
from model_shards.parallel import comm
from model_shards.parallel.state import ParallelState
from model_shards.sampler import Sampler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(flag: str, model: ModelConfig) -> torch.dtype:
    """``--dtype`` to a torch dtype; ``auto`` takes the checkpoint config's."""
    name = model.torch_dtype if flag == "auto" else flag
    return _DTYPES.get(name, torch.float32)


@dataclass
class StepResult:
    """What global rank 0 learns from one step."""

    tokens: torch.Tensor  # [S] int64, one per chunk with ``sample``
    logits: torch.Tensor | None = None  # [S, vocab] float32 when the plan asked


def broadcast_plan(plan: StepPlan, ps: ParallelState) -> None:
    comm.broadcast_bytes(encode(plan), ps, src=0)


def receive_plan(ps: ParallelState) -> StepPlan:
    return decode_plan(comm.broadcast_bytes(None, ps, src=0))


class Worker:
    def __init__(self, model: LlamaForCausalLM, ps: ParallelState, dtype: torch.dtype) -> None:
        self.model = model
        self.ps = ps
        self.dtype = dtype
        cfg = model.config
        num_kv_heads = max(1, cfg.num_kv_heads // ps.tp_size)
        self.kv = KVCache(num_kv_heads, cfg.head_dim, dtype, ps.device)
        self.sampler = Sampler()
        self.bytes_loaded = 0

    @staticmethod
    def build(
        model_dir: str, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, max_positions: int
    ) -> Worker:
        """Build this rank's stage of the model and load its slices of the checkpoint."""
        model_cls = MODEL_REGISTRY[cfg.architecture]
        with torch.device(ps.device):
            model = model_cls(cfg, dtype, ps, max_positions)
        with Checkpoint(model_dir) as checkpoint:
            load_weights(model, checkpoint)
            worker = Worker(model.eval(), ps, dtype)
            worker.bytes_loaded = checkpoint.bytes_read
        return worker

    @property
    def is_sampler(self) -> bool:
        return self.ps.is_last_stage and self.ps.tp_rank == 0

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step; returns the sampled tokens on global rank 0, else ``None``."""
        ps = self.ps
        for seq_id in plan.freed_seq_ids:
            self.kv.free(seq_id)
            self.sampler.remove(seq_id)
        if self.is_sampler:
            for new in plan.new_sequences:
                self.sampler.add(new.seq_id, new.sampling)
        if not plan.chunks:
            return None
        lengths = [len(c.token_ids) for c in plan.chunks]
        batch = ForwardBatch(
            positions=torch.cat(
                [
                    torch.arange(c.start_pos, c.start_pos + n)
                    for c, n in zip(plan.chunks, lengths, strict=True)
                ]
            ).to(ps.device),
            seq_ids=[c.seq_id for c in plan.chunks],
            starts=[c.start_pos for c in plan.chunks],
            lengths=lengths,
            kv=self.kv,
        )
        sampled = [i for i, c in enumerate(plan.chunks) if c.sample]
        hidden_shape = (batch.num_tokens, self.model.config.hidden_size)
        if ps.is_first_stage:
            ids = [t for c in plan.chunks for t in c.token_ids]
            x = torch.tensor(ids, dtype=torch.int64, device=ps.device)
        else:
            x = comm.recv_from_prev_stage(hidden_shape, self.dtype, ps)
        hidden = self.model(x, batch)  # [T, H]
        if not ps.is_last_stage:
            comm.send_to_next_stage(hidden, ps)
            return self._receive_result(plan)
        if not sampled:
            return self._receive_result(plan)
        ends = list(accumulate(lengths))
        rows = torch.tensor([ends[i] - 1 for i in sampled], device=ps.device)
        logits = self.model.compute_logits(hidden[rows])  # [S, V] float32
        if ps.tp_rank != 0:
            return None
        tokens = self.sampler.sample(logits, [plan.chunks[i].seq_id for i in sampled])
        if ps.rank == 0:
            return StepResult(tokens, logits.cpu() if plan.return_logits else None)
        comm.send_cpu(tokens, 0, ps)
        if plan.return_logits:
            comm.send_cpu(logits, 0, ps)
        return None

    def _receive_result(self, plan: StepPlan) -> StepResult | None:
        """Global rank 0, when it is not the sampler, waits for the sampler's tokens."""
        if self.ps.rank != 0:
            return None
        num_sampled = sum(1 for c in plan.chunks if c.sample)
        if num_sampled == 0:
            return StepResult(torch.empty(0, dtype=torch.int64))
        leader = self.ps.last_stage_leader
        tokens = comm.recv_cpu((num_sampled,), torch.int64, leader, self.ps)
        logits = None
        if plan.return_logits:
            vocab = self.model.config.vocab_size
            logits = comm.recv_cpu((num_sampled, vocab), torch.float32, leader, self.ps)
        return StepResult(tokens, logits)

    def serve_forever(self) -> None:
        """Non-zero ranks: execute plans from rank 0 until a shutdown plan."""
        while True:
            plan = receive_plan(self.ps)
            if plan.shutdown:
                return
            self.execute(plan)
