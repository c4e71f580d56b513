"""Every rank's step executor for an encoder replica (``tp`` ranks, ``pp == 1``).

A step's plan lists the inputs (``StepPlan.encode``, with their token types in
``encode_types``); every rank runs the padded batch through its shard of the encoder
(TP all-reduces inside) and ends with the same vectors: pooled embeddings
(``BertModel``) or a classifier's logits (``BertForSequenceClassification``);
global rank 0 returns them.
"""

from __future__ import annotations

import torch

from model_shards.backends import select_backend
from model_shards.config.encoder import EncoderConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import prepare_weights
from model_shards.messages import StepPlan
from model_shards.models.bert import BertForSequenceClassification, BertModel
from model_shards.parallel.comm import Comm, Pending
from model_shards.worker.decoder_worker import receive_plan, resolve_dtype
from model_shards.worker.loader import load_weights
from model_shards.worker.open_checkpoint import open_checkpoint

EncoderModel = BertModel | BertForSequenceClassification


class EncoderWorker:
    def __init__(self, model: EncoderModel, comm: Comm) -> None:
        self.model = model
        self.comm = comm
        self.ps = comm.ps
        self.pending = Pending()  # rank 0's plan broadcasts in progress
        self.bytes_loaded = 0

    @staticmethod
    def build(replica: ReplicaConfig, cfg: EncoderConfig, comm: Comm) -> EncoderWorker:
        device = comm.ps.device
        dtype = resolve_dtype(replica.dtype, cfg, device)
        ctx = ShardContext(comm, select_backend(device, dtype), dtype)
        with torch.device(device):
            model: EncoderModel = (
                BertModel(cfg, ctx) if cfg.head is None else BertForSequenceClassification(cfg, ctx)
            )
        with open_checkpoint(replica.model_dir) as checkpoint:
            load_weights(model, checkpoint)
            prepare_weights(model)
            worker = EncoderWorker(model.eval(), comm)
            worker.bytes_loaded = checkpoint.bytes_read
        return worker

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run ``plan.encode``: ``[B, H]`` embeddings or ``[B, num_labels]`` logits, float32,
        on every rank (``None`` when empty)."""
        if not plan.encode:
            return None
        longest = max(len(ids) for ids in plan.encode)
        types = plan.encode_types or [[] for _ in plan.encode]
        device = self.ps.device
        padded = [ids + [0] * (longest - len(ids)) for ids in plan.encode]
        padded_types = [t + [0] * (longest - len(t)) for t in types]
        input_ids = torch.tensor(padded, dtype=torch.int64, device=device)
        token_type_ids = torch.tensor(padded_types, dtype=torch.int64, device=device)
        lengths = torch.tensor([len(ids) for ids in plan.encode], device=device)
        return self.model(input_ids, token_type_ids, lengths).cpu()

    def serve_forever(self) -> None:
        """Non-zero ranks: execute plans from rank 0 until a shutdown plan."""
        while True:
            plan = receive_plan(self.comm)
            if plan.shutdown:
                return
            self.execute(plan)
