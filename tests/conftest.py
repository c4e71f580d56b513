"""Test-wide settings: nothing may reach a model hub; without a GPU, Triton kernels run in
Triton's interpreter on CPU tensors (``triton.jit`` reads the variable when a kernel is
defined, so it is set before any test module imports one)."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
