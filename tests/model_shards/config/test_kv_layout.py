"""KV groups: which layers share a table and which memory (model_shards/config/kv_layout.py)."""

from __future__ import annotations

from model_shards.config.kv_layout import KVGroup, KVLayout, peak_blocks, window_start

S, F = 512, None  # a sliding layer's window, a global layer


def test_one_group_for_full_attention() -> None:
    layout = KVLayout.of([F] * 5)
    assert layout.groups == (KVGroup(None, (0, 1, 2, 3, 4)),)
    assert layout.slots_on(range(2, 5)) == 3  # every layer its own buffer, as before


def test_gemma2_alternation_pairs_a_sliding_with_a_global_layer() -> None:
    layout = KVLayout.of([S, F, S, F])
    assert layout.groups == (KVGroup(None, (1, 3)), KVGroup(S, (0, 2)))
    assert [layout.slot_of(i) for i in range(4)] == [0, 0, 1, 1]
    assert layout.slots_on(range(4)) == 2  # a block id costs half the layers
    assert layout.windows == (None, S)


def test_gemma3_five_to_one_cuts_sliding_layers_into_groups_of_the_global_count() -> None:
    windows = [F if (i + 1) % 6 == 0 else S for i in range(26)]  # Gemma 3 1B: 4 global
    layout = KVLayout.of(windows)
    sizes = [len(g.layers) for g in layout.groups]
    assert sizes == [4, 4, 4, 4, 4, 4, 2]  # 22 sliding: five groups of four, one of two
    assert layout.groups[0].window is None
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(26))
    assert layout.slots_on(range(26)) == 4
    assert layout.slots_on(range(13)) == 4


def test_all_sliding_model_is_one_windowed_group() -> None:
    assert KVLayout.of([S] * 3).groups == (KVGroup(S, (0, 1, 2)),)


def test_window_start_follows_transformers_mask() -> None:
    # kv > q - window: a query at 10 with window 4 sees 7, 8, 9, 10
    assert window_start(4, 10) == 7
    assert window_start(4, 2) == 0
    assert window_start(None, 99) == 0


def test_peak_blocks_bounds_windowed_groups() -> None:
    # global: ceil(100 / 4) = 25; window 6 with chunks of 8: ceil(13 / 4) + 1 = 5
    assert peak_blocks((None, 6), 100, 4, 8) == 25 + 5
    assert peak_blocks((6,), 8, 4, 8) == 2  # never more than the sequence itself
