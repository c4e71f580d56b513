"""What the parsed ``shardserve`` flags (:mod:`server.cli.args`) become: the replica they
describe (:func:`replica_config`), and the checks of combinations argparse cannot see
(:func:`check_serve_flags`, :func:`engine_address_problem`), each a ``ValueError`` naming the
flags, before anything starts."""

from __future__ import annotations

import argparse

from model_shards.config.replica import ReplicaConfig
from model_shards.launch import packaged_model
from server.cli.args import ENGINE_ADDRESS_FORMS


def replica_config(args: argparse.Namespace) -> ReplicaConfig:
    """The replica the flags describe (not validated); the packaged default model if no
    ``--model`` (``ValueError`` naming the pip command if it is not installed)."""
    model_dir = args.model if args.model is not None else str(packaged_model.packaged_gguf())
    return ReplicaConfig(
        model_dir=model_dir,
        tp=args.tensor_parallel_size,
        pp=args.pipeline_parallel_size,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        enable_prefix_caching=args.prefix_caching,
        pipeline_overlap=args.pipeline_overlap,
        pp_layer_partition=args.pp_layer_partition,
        enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        threads_per_rank=args.cpu_threads_per_rank,
        dp_attention=getattr(args, "dp_attention", False),
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        scheduling_policy=args.scheduling_policy,
        enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules or ()),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        speculative_config=args.speculative_config,
        async_scheduling=args.async_scheduling,
    )


def engine_address_problem(address: str) -> str | None:
    """Why ``address`` is no engine address a frontend can connect to, or ``None``."""
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return None
    host, colon, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not (host and colon and port):
        return f"expected {ENGINE_ADDRESS_FORMS}"
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"port {port!r} is not in 1..65535"
    return None


def check_serve_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag when ``serve``'s ``--engine`` is misused."""
    for i, address in enumerate(args.engine):
        problem = engine_address_problem(address)
        if problem:
            raise ValueError(f"--engine {address}: {problem}")
        if address in args.engine[:i]:
            raise ValueError(f"--engine {address} is given twice; each --engine is one replica")
    if args.engine and args.data_parallel_size != 1:
        raise ValueError(
            "--data-parallel-size starts replicas; with --engine, give one --engine per replica"
        )
    if args.dp_attention:
        from model_shards.launch.dp_attention import check_dp_attention_args

        check_dp_attention_args(args)
