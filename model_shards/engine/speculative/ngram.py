"""Prompt lookup (n-gram) proposals over a sequence's own prompt and output."""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram (``lo <= n <= hi``) of a growing token list last occurred with a token
    after it: ``_after[ngram]`` is the position right after that occurrence.

    :meth:`propose` finds the longest suffix of the list (``hi`` down to ``lo`` tokens) that
    occurred before and returns up to ``k`` tokens that followed its latest occurrence.
    Indexing is incremental: each call indexes only the tokens appended since the last.
    """

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 1  # occurrences ending before this position are indexed

    def _update(self, tokens: list[int]) -> None:
        for end in range(self._indexed, len(tokens)):  # tokens[end] follows the n-gram
            for n in range(self.lo, min(self.hi, end) + 1):
                self._after[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens of ``tokens`` (empty: no earlier match)."""
        self._update(tokens)
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            end = self._after.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []
