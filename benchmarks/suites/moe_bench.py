"""The mixture-of-experts rows of ``make bench``: a Mixtral-shaped random model on 2 cores.

:class:`MoEShape`: hidden 512, 4 layers, 8 query / 4 key-value heads of 64, 8 experts of
intermediate 1024 per layer, top 2, vocab 4096, tied embeddings (the rows of ids >= 1024
and of the single-byte tokens zeroed, as :mod:`benchmarks.harness.model` does, so greedy decoding
of random weights emits decodable text). Written once into ``benchmarks/.cache``.

At concurrency 32 in float32, the same prompts and load as the other tables:

- shardserve tp=1 and ``transformers serve`` up at once, alternating, then ``generate()``;
- shardserve tp=2 (every expert sliced over both ranks) and tp=2 with
  ``--enable-expert-parallel`` (4 whole experts per rank), both up at once, alternating.

``python -m benchmarks suites moe_bench --concurrency 4 --out /tmp/moe.json`` runs these rows
alone, at a reduced scale if asked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import servers
from benchmarks.harness.bench import Bench, Target, alternate, start_hf_serve
from benchmarks.harness.machine import machine
from benchmarks.harness.model import SEED, ensure_checkpoint, zero_undecodable_embeddings
from benchmarks.harness.paths import CACHE
from benchmarks.harness.tables import ratio, tok_cell

VERSION = "v1"  # bump when the bytes change
LAYOUTS = {
    "tp1": "mixtral-shaped tp1",
    "tp2": "mixtral-shaped tp2",
    "ep": "mixtral-shaped tp2 + expert parallel",
}


@dataclass(frozen=True, slots=True)
class MoEShape:
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 1024
    vocab: int = 4096
    max_positions: int = 2048

    def active_matmul_params(self) -> int:
        """Weights multiplied per token: attention, router, the top-k experts, LM head."""
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        experts = self.top_k * 3 * self.hidden * self.expert_intermediate
        router = self.hidden * self.experts
        return self.layers * (attn + experts + router) + self.vocab * self.hidden


SHAPE = MoEShape()


def model_dir() -> Path:
    return CACHE / f"mixtral-moe-{VERSION}"


def ensure_moe_model() -> Path:
    """The checkpoint directory, written first if missing (temp dir + rename)."""
    return ensure_checkpoint(model_dir(), lambda path: _write(path, SHAPE))


def _write(path: Path, shape: MoEShape) -> None:
    import torch
    import transformers

    from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID, write_tokenizer

    config = transformers.MixtralConfig(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.expert_intermediate,
        num_local_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.max_positions,
        sliding_window=None,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    torch.manual_seed(SEED)
    model = transformers.MixtralForCausalLM(config).float()
    zero_undecodable_embeddings(model)
    model.save_pretrained(path)
    write_tokenizer(path, max_length=shape.max_positions)


def _start_ours(stack: contextlib.ExitStack, flags: list[str], layout: str) -> Target:
    log = CACHE / "logs" / f"shardserve-moe-{layout.replace(' ', '_')}.log"
    command = servers.ours_command(ensure_moe_model(), "float32", flags)
    return ("shardserve", stack.enter_context(servers.running(command, log)), "")


def run_moe(bench: Bench, c: int) -> None:
    """The rows of the module docstring, at concurrency ``c`` (every server stopped on exit)."""
    dtype, model = "float32", ensure_moe_model()
    with contextlib.ExitStack() as stack:
        ours = _start_ours(stack, [], LAYOUTS["tp1"])
        hf = start_hf_serve(stack, dtype, model)
        for target in (ours, hf):
            bench.http_point(target, dtype, None, "")
        alternate(bench, [(ours, LAYOUTS["tp1"]), (hf, LAYOUTS["tp1"])], dtype, c)
    bench.generate_point(dtype, c, model, LAYOUTS["tp1"])
    with contextlib.ExitStack() as stack:
        pair = [
            (_start_ours(stack, ["-tp", "2"], LAYOUTS["tp2"]), LAYOUTS["tp2"]),
            (
                _start_ours(stack, ["-tp", "2", "--enable-expert-parallel"], LAYOUTS["ep"]),
                LAYOUTS["ep"],
            ),
        ]
        for target, _ in pair:
            bench.http_point(target, dtype, None, "")
        alternate(bench, pair, dtype, c)


def moe_table(result: dict[str, Any]) -> str:
    """Ours against both baselines at tp=1, then tp=2 against tp=2 with expert parallelism."""
    rows = [r for r in result["rows"] if r["layout"] in LAYOUTS.values()]
    if not rows:
        return "(not measured)"
    tok = {(r["system"], r["layout"]): float(r["output_throughput"]) for r in rows}
    lines = [
        "| system, layout (Mixtral-shaped, float32) | output tok/s | vs hf-serve "
        "| vs hf-generate | vs tp2 |",
        "|---|---:|---:|---:|---:|",
    ]
    serve, generate = (
        tok.get(("hf-serve", LAYOUTS["tp1"])),
        tok.get(("hf-generate", LAYOUTS["tp1"])),
    )
    for r in rows:
        key = (r["system"], r["layout"])
        ours = r["system"] == "shardserve"
        vs_serve = ratio(tok[key], serve) if ours else ""
        vs_gen = ratio(tok[key], generate) if ours else ""
        vs_tp2 = ratio(tok[key], tok.get(("shardserve", LAYOUTS["tp2"])))
        vs_tp2 = vs_tp2 if r["layout"] == LAYOUTS["ep"] else ""
        lines.append(
            f"| {r['system']}, {r['layout']} (c={r['concurrency']}) | {tok_cell(r)} "
            f"| {vs_serve} | {vs_gen} | {vs_tp2} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """These rows alone (``--concurrency``: reduced scale), written to ``--out``."""
    parser = argparse.ArgumentParser(description="the MoE rows of make bench, alone")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", default="/tmp/moe-bench.json")
    args = parser.parse_args(argv)
    bench = Bench([args.concurrency])
    run_moe(bench, args.concurrency)
    result = {"machine": machine(), "rows": bench.rows, "notes": bench.notes}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(moe_table(result))
    print("\n".join(f"- {n}" for n in bench.notes))
    return 0
