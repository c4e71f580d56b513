"""The speculative-decoding workloads' prompts (``suites/spec_decode.py`` serves them;
``micro/spec_steps.py`` runs them on the engine alone).

**editing** hands over a code or text block and asks for it back with a small change (the
output quotes the prompt: prompt lookup's best case); **chat** asks plain questions. Each
prompt opens with its own line, so no request hits another's prefix cache.
"""

from __future__ import annotations

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
"""The n-gram ``--speculative-config`` the suite serves."""
OUTPUT_LEN = 96
"""Greedy tokens a request at most (the speculative bench: it ends at its end of turn)."""

SNIPPETS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    return sum((v - m) ** 2 for v in values) / len(values)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return not self.items\n",
    "The meeting is on Tuesday at ten in the small room on the second floor. Please bring the "
    "report, the budget for next year and the list of open questions. Lunch will be served "
    "after the meeting, and the slides will be sent to everyone on Wednesday.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n"
    "        print(i, 'is odd')\nprint('done counting')\n",
]
CHANGES = ["Rename `values` to `xs`.", "Add a one-line comment at the top.", "Fix any typo."]
QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Give me three tips for sleeping better.",
    "Explain what a binary search does, briefly.",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
]


def chatml(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts(workload: str, count: int, tag: str) -> list[str]:
    """``count`` prompts of ``workload``, each opening with its own line (no shared prefix)."""
    out = []
    for i in range(count):
        if workload == "editing":
            snippet, change = SNIPPETS[i % len(SNIPPETS)], CHANGES[i % len(CHANGES)]
            body = f"Return this text with one change. {change}\n\n{snippet}"
        else:
            body = QUESTIONS[i % len(QUESTIONS)]
        out.append(chatml(f"(request {tag}-{i})\n{body}"))
    return out
