"""The speculative-decoding suite's prompts and table (the measuring itself is ``make bench``)."""

from __future__ import annotations

from benchmarks.harness.spec_prompts import SNIPPETS
from benchmarks.suites.spec_decode import LAYOUT, SPEC_NGRAM, SPEC_NONE, prompts, spec_table


def test_prompts_share_no_prefix_and_editing_quotes_a_block() -> None:
    editing = prompts("editing", 8, "t")
    assert len({p.split("\n")[1] for p in editing}) == 8  # each opens with its own line
    assert all(any(s in p for s in SNIPPETS) for p in editing)
    assert all(p.endswith("<|im_start|>assistant\n") for p in prompts("chat", 3, "t"))


def test_table_shows_the_ratio_and_acceptance() -> None:
    def row(system: str, tok_s: float, acc: float | None, r: int) -> dict[str, object]:
        return {
            "layout": LAYOUT,
            "system": system,
            "workload": "editing",
            "concurrency": 1,
            "round": r,
            "output_throughput": tok_s,
            "spec_acceptance": acc,
            "spec_tokens_per_step": None if acc is None else 1 + 4 * acc,
        }

    rows = [row(SPEC_NONE, 10.0, None, 0), row(SPEC_NGRAM, 18.0, 0.5, 0)]
    rows += [row(SPEC_NONE, 12.0, None, 1), row(SPEC_NGRAM, 20.0, 0.7, 1)]
    table = spec_table({"rows": rows})
    rows.append(row("draft-self", 9.0, 1.0, 0))
    table = spec_table({"rows": rows})
    assert "| editing | 1 | ngram | 10.0 | 18.0 | 1.80× | 50% | 3.00 |" in table
    assert "| editing | 1 | draft-self | 10.0 | 9.0 | 0.90× | 100% | 5.00 |" in table
    assert spec_table({"rows": []}) == "(speculative decoding not measured)"
