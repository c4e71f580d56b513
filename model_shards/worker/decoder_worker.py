"""Every rank's step executor: run this stage of the model on a :class:`StepPlan`.

One step, the same plan on every rank:

1. drop freed sequences' block tables, extend the others; the sampling rank registers new
   sequences, the fed tokens and the step's grammar masks;
2. the first stage embeds the token ids, later stages receive hidden states ``[T, H]``;
3. run this stage's layers (TP all-reduces inside), writing K/V into the pool;
4. non-last stages send ``[T, H]`` on; the last scores the prompt rows chunks ask for
   (:mod:`~model_shards.worker.prompt_logprobs`) and computes logits of each sampled chunk's
   final token; its TP rank 0 samples and sends the result to global rank 0
   (:mod:`~model_shards.worker.step_result`).
"""

from __future__ import annotations

import logging
import os

import torch

from model_shards.backends import Backend, select_backend
from model_shards.backends.cuda.graphs import GraphBackend
from model_shards.backends.future_tokens import read_future_tokens_
from model_shards.config.encoder import EncoderConfig
from model_shards.config.kv_layout import KVLayout
from model_shards.config.model import ModelConfig
from model_shards.config.quantization import CPU_ONLY_QUANTIZATION
from model_shards.config.replica import ReplicaConfig
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import prepare_weights
from model_shards.messages import SeqChunk, StepPlan, decode_plan, encode
from model_shards.models import MODEL_REGISTRY, DecoderModel
from model_shards.models.decoder import StepPositions
from model_shards.parallel.comm import (
    Comm,
    Pending,
    broadcast_bytes,
    broadcast_bytes_from_root,
    recv_from_prev_stage,
    send_to_next_stage,
)
from model_shards.parallel.state import ParallelState
from model_shards.worker.decode_graphs import DecodeGraphs
from model_shards.worker.future_tokens import FutureTokens
from model_shards.worker.kv_budget import kv_cache_blocks
from model_shards.worker.kv_cache import PagedKVCache
from model_shards.worker.kv_scales import KVScaleStore, kv_pool_dtype, set_pool_scales
from model_shards.worker.loader import load_weights
from model_shards.worker.lora_adapters import LoraAdapters
from model_shards.worker.media_inputs import MediaInputs, takes_images
from model_shards.worker.open_checkpoint import open_checkpoint
from model_shards.worker.piecewise_graphs import (
    PIECEWISE_ENV,
    PiecewiseGraphs,
    piecewise_for,
)
from model_shards.worker.prompt_logprobs import score_prompts
from model_shards.worker.quant_sources import QuantizedStore
from model_shards.worker.sampler import SampleOutput, Sampler
from model_shards.worker.spec_rows import sampled_rows
from model_shards.worker.step_result import (
    PendingResult,
    StepResult,
    recv_step_result,
    send_step_result,
)
from model_shards.worker.step_trace import OFF, StepTrace

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    flag: str, model: ModelConfig | EncoderConfig, device: torch.device | None = None
) -> torch.dtype:
    """``--dtype`` to a torch dtype; ``auto`` takes the checkpoint config's, except that on
    CUDA a float32 checkpoint is served in bfloat16 (as vLLM does; logged)."""
    name = model.torch_dtype if flag == "auto" else flag
    if name not in _DTYPES:  # config.json's torch_dtype is checked at validation
        raise ValueError(f"dtype {name!r} is not supported; supported: {', '.join(_DTYPES)}")
    dtype = _DTYPES[name]
    if flag == "auto" and dtype == torch.float32 and device is not None and device.type == "cuda":
        log.info("--dtype auto: the float32 checkpoint is served in bfloat16 on %s", device)
        return torch.bfloat16
    return dtype


def broadcast_plan(plan: StepPlan, comm: Comm, pending: Pending) -> None:
    """Rank 0: send the plan to every rank without waiting for them to take it."""
    broadcast_bytes_from_root(encode(plan), comm, pending)


def receive_plan(comm: Comm) -> StepPlan:
    return decode_plan(broadcast_bytes(None, comm, src=0))


class Worker:
    def __init__(
        self,
        model: DecoderModel,
        ctx: ShardContext,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``kv_dtype``: the pools' (:func:`kv_pool_dtype`); default the model's."""
        self.model = model
        self.ctx = ctx
        self.comm = ctx.comm
        self.ps = ps = ctx.ps
        self.ops = ctx.ops
        self.dtype = dtype = ctx.dtype
        cfg = model.config
        layers = range(model.model.start, model.model.end)
        self.kv = PagedKVCache.for_stage(
            cfg, layers, ps.tp_size, num_blocks, block_size, kv_dtype or dtype, ps.device
        )
        self.sampler = Sampler(ctx.ops)
        self.graphs: DecodeGraphs | None = None  # set by build() on a backend with graphs
        self.piecewise: PiecewiseGraphs | None = None  # mixed steps' graphs (build(), opt-in)
        self.bytes_loaded = 0
        self.pending = Pending()  # non-blocking sends in progress
        # a vision-language model's first stage: images of its sequences, encoder cache
        self.media = MediaInputs(model, ps.device) if takes_images(model, ps) else None  # type: ignore[arg-type]
        # a model with its own position streams (M-RoPE): every rank tracks them
        self.positions: StepPositions | None = getattr(model, "step_positions", None)
        self.lora: LoraAdapters | None = None  # --enable-lora: set by build()
        self.futures = FutureTokens(ctx.comm)  # async scheduling: what future tokens read

    @staticmethod
    def build(
        replica: ReplicaConfig,
        cfg: ModelConfig,
        comm: Comm,
        max_model_len: int,
        ops: Backend | None = None,
        ep_comm: Comm | None = None,
    ) -> Worker:
        """Build this rank's stage, load its checkpoint slices, size the KV pool. ``ops``: the
        backend (default: :func:`select_backend`); ``ep_comm``: DP attention's expert group."""
        ps = comm.ps
        dtype = resolve_dtype(replica.dtype, cfg, ps.device)
        if ops is None:
            ops = select_backend(ps.device, dtype, batch_invariant=replica.batch_invariant)
        ep, quantization = replica.enable_expert_parallel, replica.quantization
        if quantization in CPU_ONLY_QUANTIZATION and ps.device.type != "cpu":
            raise ValueError(f"--quantization {quantization}: CPU only, not on {ps.device}")
        kv_dtype = kv_pool_dtype(replica, dtype, ops, cfg)
        ctx = ShardContext(comm, ops, dtype, ep, ep_comm, quantization)
        model_cls = MODEL_REGISTRY[cfg.architecture]
        with torch.device(ps.device):
            model = model_cls(cfg, ctx, max_model_len, replica.pp_layer_partition)
        with open_checkpoint(replica.model_dir) as checkpoint:
            quantized = None if cfg.quant is None else QuantizedStore(checkpoint, cfg.quant)
            store = KVScaleStore(quantized or checkpoint)  # K/V scales: not parameters
            load_weights(model, store)
            stage = range(model.model.start, model.model.end)
            kv_scales = store.read(stage, required=cfg.kv_fp8_scales)
            bytes_read = checkpoint.bytes_read
        prepare_weights(model)
        lora_opts = replica.lora_options()
        lora = None if lora_opts is None else LoraAdapters(model.model, cfg, ctx, lora_opts)
        graph_backend = _graph_backend(replica, ops, ps, cfg, model)
        blocks = kv_cache_blocks(
            cfg,
            replica,
            comm,
            model.eval(),
            kv_dtype,
            max_model_len,
            graphs=graph_backend is not None,
        )
        worker = Worker(model, ctx, blocks, replica.block_size, kv_dtype)
        set_pool_scales(worker.kv, kv_scales)
        if graph_backend is not None:
            worker.graphs = DecodeGraphs(
                worker.model, worker.kv, replica.max_num_seqs, max_model_len, graph_backend, ops
            )
            if lora is not None:  # the graphs read each row's adapter slot as an input
                lora.graph_slots(len(worker.graphs.rows))
            worker.graphs.capture()
        plain = worker.media is None and worker.positions is None
        if graph_backend is not None and plain and os.environ.get(PIECEWISE_ENV) == "1":
            chunk = replica.max_num_batched_tokens
            worker.piecewise = piecewise_for(model, graph_backend, chunk, ps.device, dtype)
            if worker.piecewise is not None:
                worker.piecewise.capture()
        worker.bytes_loaded = bytes_read
        worker.lora = lora
        return worker

    @property
    def is_sampler(self) -> bool:
        return self.ps.is_last_stage and self.ps.tp_rank == 0

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, wait: bool = True, trace: StepTrace = OFF
    ) -> StepResult | PendingResult | None:
        """Run this rank's stage of one step. Global rank 0 gets the result if it is the sampler
        (on its way to the host: ``get()`` it) or ``wait`` (else :meth:`collect` it later, in
        plan order); other ranks get ``None``.
        ``trace``: rank 0's TTFT stamps of the step (:mod:`model_shards.worker.step_trace`)."""
        ps = self.ps
        for seq_id in plan.freed_seq_ids:
            self.kv.free(seq_id)
            self.sampler.remove(seq_id)
        if self.media is not None:
            self.media.observe(plan)
        if self.positions is not None:
            self.positions.observe(plan)
        if self.is_sampler:
            for new in plan.new_sequences:
                self.sampler.add(new)
            for chunk in plan.chunks:
                self.sampler.observe(chunk)
            self.sampler.set_masks(plan.token_masks)
        if self.lora is not None:
            self.lora.load(plan.lora_loads)
        if not plan.chunks:
            return None
        self.kv.extend_tables(plan.chunks)
        graphed = self.graphs is not None and all(
            len(c.token_ids) == 1 and c.score is None for c in plan.chunks
        )
        graphed = graphed and (self.media is None or not self.media.touches(plan.chunks))
        futures = self.futures.source(plan.chunks)  # [S] of the step before, or None
        with trace.forward(self.model):
            stage_out = self._forward(plan.chunks, graphed, futures)  # [T, H] (graph: [T, V])
        if not ps.is_last_stage:
            send_to_next_stage(stage_out, self.comm, self.pending)
            return self.collect(plan) if wait and ps.rank == 0 else None
        leader = ps.tp_rank == 0  # the sampler
        scores = None if graphed else score_prompts(self.model, stage_out, plan.chunks, leader)
        out = self._sample(plan.chunks, stage_out, graphed, trace)
        self.futures.record(plan.chunks, None if out is None else out.tokens)
        if not leader:
            return None
        if ps.rank == 0:
            return PendingResult(out, scores, plan.chunks, self.ops)
        if out is not None or scores is not None:
            send_step_result(out, scores, self.comm, self.pending)
        return None

    def _sample(
        self, chunks: list[SeqChunk], stage_out: torch.Tensor, graphed: bool, trace: StepTrace
    ) -> SampleOutput | None:
        """Last stage: the LM head over each sampled chunk's last row of ``stage_out`` (or the
        graph's logits), then (TP rank 0) the sampler; ``None`` elsewhere or if none samples."""
        sampled = [i for i, c in enumerate(chunks) if c.sample]
        if not sampled:
            return None
        views = [chunks[i] for i in sampled]
        if graphed:
            logits = stage_out if len(sampled) == len(chunks) else stage_out[sampled]
        else:
            row_list, views = sampled_rows(chunks)  # a verify chunk samples K + 1 rows
            rows = self.kv.to_device(row_list)
            logits = self.model.compute_logits(stage_out[rows])  # [S, V]
            trace.stamp("lm_head_done")
        if self.ps.tp_rank != 0:
            return None
        out = self.sampler.sample(logits, views)
        trace.stamp("sampled")
        return out

    def _forward(
        self, chunks: list[SeqChunk], graphed: bool, futures: torch.Tensor | None
    ) -> torch.Tensor:
        """This stage's pass: ``[T, H]``, or logits ``[T, V]`` on the last stage when ``graphed``
        (a decode-only step replaying a graph that holds the LM head). The metadata is built
        before waiting on the previous stage, so host work overlaps its compute. ``futures``:
        the previous step's sampled ids, which token ids ``< 0`` stand for (async scheduling)."""
        ps = self.ps
        batch = None if graphed else ForwardBatch.build(chunks, self.kv)
        if batch is not None and self.positions is not None:
            batch.rotary_rows = self.positions.rotary_rows(chunks)
        if self.lora is not None:
            self.lora.set_batch(chunks, graphed=batch is None)
        hidden: torch.Tensor | None = None
        if not ps.is_first_stage:
            shape = (sum(len(c.token_ids) for c in chunks), self.model.config.hidden_size)
            hidden = recv_from_prev_stage(shape, self.dtype, self.comm)
        if batch is None:
            assert self.graphs is not None  # graphed: only with captured graphs
            return self.graphs.run(chunks, hidden, futures)
        if hidden is None:
            ids = [t for c in chunks for t in c.token_ids]
            hidden = self.kv.to_device(ids)  # [T] int64
            if futures is not None:
                read_future_tokens_(hidden, futures)
            if self.media is not None:  # token embeddings with the images' rows in
                hidden = self.media.embed(hidden, chunks)  # [T, H]
        if self.piecewise is not None:
            out = self.piecewise.run(hidden, batch)  # None: above the largest bucket
            if out is not None:  # a view the next step rewrites: a copy to send on
                return out if ps.is_last_stage else out.clone()
        return self.model(hidden, batch)  # [T, H]

    def collect(self, plan: StepPlan) -> StepResult:
        """Global rank 0, when it is not the sampler: wait for the sampler's result of ``plan``."""
        return recv_step_result(plan, self.comm, self.ps.last_stage_leader)

    def serve_forever(self) -> None:
        """Non-zero ranks: execute plans from rank 0 until a shutdown plan."""
        while True:
            plan = receive_plan(self.comm)
            if plan.shutdown:
                self.pending.wait_all()
                return
            self.execute(plan)


def _graph_backend(
    replica: ReplicaConfig, ops: Backend, ps: ParallelState, cfg: ModelConfig, model: DecoderModel
) -> GraphBackend | None:
    """What captures this rank's decode steps; ``None``: eager (why is logged, if not asked)."""
    graph_backend = None if replica.enforce_eager else ops.graph_backend()
    if graph_backend is not None and ps.host_tensors:
        log.info("decode graphs off: the ranks share one GPU (host copies in TP)")
        return None
    if graph_backend is not None and KVLayout.for_model(cfg).num_groups > 1:
        log.info("decode graphs off: %s keeps several KV groups", cfg.architecture)
        return None  # the captured inputs hold one group's tables
    if graph_backend is not None and getattr(model, "step_positions", None) is not None:
        log.info("decode graphs off: %s has its own position streams", cfg.architecture)
        return None  # the captured inputs index the model's tables
    return graph_backend
