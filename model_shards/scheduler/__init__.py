"""Rank 0's scheduling decisions, in pure Python (no torch.distributed)."""
