"""The rows a step samples after: a chunk's last, or a verify chunk's last ``num_draft + 1``.

A speculative chunk ``[t, d_1 .. d_K]`` (``num_draft = K``) asks for a sample after each of its
last ``K + 1`` positions. Each row is handed to the sampler as the chunk that would end there
(its tokens cut after that position, no drafts): the sampler then treats it exactly as a
one-token-a-step decode at that position (seeded draw, penalties over the history up to it,
``min_tokens``), which is what makes the accept rule exact
(:mod:`model_shards.engine.speculative.verify`).
"""

from __future__ import annotations

import msgspec

from model_shards.messages import SeqChunk


def sampled_rows(chunks: list[SeqChunk]) -> tuple[list[int], list[SeqChunk]]:
    """Rows of the step's ``[T, H]`` to sample after, in order, and the chunk the sampler sees
    for each (``len(rows) == sum(1 + num_draft)`` over the sampled chunks)."""
    rows: list[int] = []
    views: list[SeqChunk] = []
    end = 0
    for chunk in chunks:
        end += len(chunk.token_ids)
        if not chunk.sample:
            continue
        k = chunk.num_draft
        rows.extend(range(end - 1 - k, end))
        if k == 0:
            views.append(chunk)
            continue
        n = len(chunk.token_ids) - k
        views.extend(
            msgspec.structs.replace(chunk, token_ids=chunk.token_ids[: n + j], num_draft=0)
            for j in range(k + 1)
        )
    return rows, views
