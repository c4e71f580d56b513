"""splitmix64 against an independent implementation of the reference generator and its
published outputs, and every user of the hash against it: the position seeds, the race's
uniforms (reference backend, the cpu kernel's draw rides on them) and the choices' seeds."""

from __future__ import annotations

import torch

from model_shards.backends.reference import race_uniforms
from model_shards.splitmix import mix64, splitmix64
from model_shards.worker.sampler import position_seed
from server.api.choices import sample_seed

_M64 = 0xFFFFFFFFFFFFFFFF
SEEDS = [0, 1, 7, 1234567, 2**32 + 5, 2**63 - 1, -1, -5, -(2**63)]


class ReferenceSplitMix64:
    """The generator as Vigna's splitmix64.c writes it, on an unsigned 64-bit state."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _M64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)


def _stream(seed: int, count: int) -> list[int]:
    generator = ReferenceSplitMix64(seed)
    return [generator.next() for _ in range(count)]


def test_the_reference_generator_gives_the_published_outputs() -> None:
    assert _stream(0, 1) == [0xE220A8397B1DCDAF]
    assert _stream(1234567, 5) == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


def test_splitmix64_is_the_reference_stream() -> None:
    for seed in SEEDS:
        assert [splitmix64(seed, i) for i in range(1, 41)] == _stream(seed, 40), seed
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_mix64_is_the_output_function_of_the_stream() -> None:
    for seed in SEEDS:
        assert mix64(seed + 0x9E3779B97F4A7C15) == _stream(seed, 1)[0]


def test_position_seed_is_the_output_function_of_seed_golden_position() -> None:
    for seed in SEEDS:
        for position in (0, 1, 2, 99, 4095, 2**40):
            z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _M64
            expected = mix64(z) & (2**63 - 1)
            assert position_seed(seed, position) == expected
    # pinned: a change of these changes every seeded completion
    assert position_seed(0, 0) == 6238072747940578789
    assert position_seed(42, 7) == 7574204745853770507
    assert position_seed(-1, 4095) == 440109137205594196


def test_race_uniforms_are_the_top_53_bits_of_the_stream() -> None:
    vocab = 300
    uniforms = race_uniforms(torch.tensor(SEEDS, dtype=torch.int64), vocab)
    for row, seed in enumerate(SEEDS):
        expected = [((z >> 11) + 0.5) * 2.0**-53 for z in _stream(seed, vocab)]
        assert uniforms[row].tolist() == expected, seed


def test_choice_seeds_keep_the_users_seed_first_then_follow_its_stream() -> None:
    for seed in SEEDS:
        seeds = [sample_seed(seed, j, 8) for j in range(8)]
        assert seeds[0] == seed
        assert seeds[1:] == [z >> 1 for z in _stream(seed, 7)]
        assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds[1:])
