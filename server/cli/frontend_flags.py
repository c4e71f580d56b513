"""Flags of how the frontend reads the model's output, and ``run-batch``'s own (a leaf module).

``--tool-call-parser`` and ``--reasoning-parser`` take vLLM's names (:mod:`server.text.
tool_parsers`, :mod:`server.text.reasoning`); an unknown name is an argparse error naming
the flag (exit 2), before anything starts.
"""

from __future__ import annotations

import argparse

from server.cli.flag_types import non_empty, positive_int
from server.text.reasoning import PARSERS as REASONING_PARSERS

#: ``--tool-call-parser`` values (vLLM's names; :mod:`server.text.tool_parsers`).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")

#: How many batch lines ``run-batch`` runs at once unless told.
DEFAULT_BATCH_CONCURRENCY = 64


def add_output_parser_flags(command: argparse.ArgumentParser) -> None:
    """``--tool-call-parser``, ``--enable-auto-tool-choice`` and ``--reasoning-parser``."""
    command.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how tool_choice auto reads the model's tool calls (default: from the chat template)",
    )
    command.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility (auto tool choice is on whenever a parser is known)",
    )
    command.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split the answer's <think> block into message.reasoning_content (and "
        "reasoning) on /v1/chat/completions (default: none, it stays in the content)",
    )


def add_run_batch_flags(command: argparse.ArgumentParser) -> None:
    """``run-batch``'s input and output files and its concurrency."""
    files = command.add_argument_group("batch file (OpenAI's JSONL batch format)")
    files.add_argument(
        "-i",
        "--input-file",
        type=non_empty,
        required=True,
        metavar="PATH",
        help="one request per line: {custom_id, method: POST, url, body}",
    )
    files.add_argument(
        "-o",
        "--output-file",
        type=non_empty,
        required=True,
        metavar="PATH",
        help="one result per line, appended; lines whose custom_id it holds already are "
        "skipped (a run that stopped resumes where it was)",
    )
    files.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=DEFAULT_BATCH_CONCURRENCY,
        metavar="N",
        help=f"lines in flight at once (default {DEFAULT_BATCH_CONCURRENCY})",
    )
