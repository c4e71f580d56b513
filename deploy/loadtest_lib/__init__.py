"""Pieces of ``deploy/loadtest.py``, one job per module.

``config`` (frozen run settings) → ``workload`` (prompts) and ``arrivals`` (when to send)
→ ``runner`` (one load point, using ``client`` to stream one request into a
``records.RequestRecord``) → ``metrics`` (per-point numbers) → ``results`` (versioned JSON),
``report`` (stdout tables) and ``plots`` (PNG charts). ``progress`` draws the stderr bar.
"""
