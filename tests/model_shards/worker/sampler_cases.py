"""Samplers for tests: one over given sampling parameters, and the reference backend posing
as a device backend."""

from __future__ import annotations

from model_shards.backends import ReferenceBackend
from model_shards.messages import NewSequence, SamplingParams
from model_shards.worker.sampler import Sampler


def make_sampler(params: dict[int, SamplingParams], prompt_len: int = 2) -> Sampler:
    sampler = Sampler(ReferenceBackend())
    for seq_id, p in params.items():
        sampler.add(NewSequence(seq_id, p, prompt_len, stop_token_ids=[3]))
    return sampler


class OnDeviceReference(ReferenceBackend):
    """The reference ops, but the sampler takes its batched on-device path (the cuda
    backend's), here on CPU tensors."""

    samples_on_device = True
