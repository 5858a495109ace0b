"""Tests for kmp.tools.bench.stats: the fewest steps, blocks, and the
bootstrap intervals of ratios (on made-up block times; nothing is timed)."""

import numpy as np
import pytest

from kmp.tools.bench import stats as bench_stats

# The same on every backend: CI runs it on TensorFlow only.
pytestmark = pytest.mark.anybackend


@pytest.mark.parametrize(
    "steps, rounds, allowed",
    [(100, 5, True), (1, 1, False), (99, 5, False), (100, 4, False)],
    ids=["the_fewest", "one_step", "one_short", "too_few_rounds"],
)
def test_check_counts_refuses_fewer_than_five_rounds_of_twenty(
    steps, rounds, allowed
):
    assert (bench_stats.check_counts(steps, rounds) is None) == allowed


def test_blocks_split_a_round_evenly():
    assert bench_stats.block_sizes(20) == [5] * 4
    assert bench_stats.block_sizes(1000) == [100] * 10
    assert sum(bench_stats.block_sizes(37)) == 37
    assert bench_stats.blocks_per_round(3) == 1


def _rounds(rng, median, spread, rounds=5, blocks=4):
    return median * (1 + spread * rng.standard_normal((rounds, blocks)))


def test_the_interval_holds_the_ratio_and_is_seeded():
    rng = np.random.default_rng(1)
    a, b = _rounds(rng, 2.0, 0.01), _rounds(rng, 1.0, 0.01)
    low, high = bench_stats.ratio_interval(a, b)
    ratio = np.median(a) / np.median(b)
    assert low <= ratio <= high
    assert high - low < 0.05 * ratio
    assert not bench_stats.is_noisy(ratio, (low, high))
    assert bench_stats.ratio_interval(a, b) == (low, high)
    assert bench_stats.ratio_interval(a, b, seed=1) != (low, high)


def test_noisy_blocks_give_a_wide_interval_that_is_flagged():
    rng = np.random.default_rng(2)
    a, b = _rounds(rng, 2.0, 0.3), _rounds(rng, 1.0, 0.3)
    low, high = bench_stats.ratio_interval(a, b)
    assert bench_stats.is_noisy(np.median(a) / np.median(b), (low, high))


def test_drift_shared_by_a_round_cancels():
    # Both slow down alike from round to round: the ratio stays 2.
    drift = np.linspace(1.0, 3.0, 5)[:, None]
    a = 2.0 * drift * np.ones((5, 4))
    b = 1.0 * drift * np.ones((5, 4))
    low, high = bench_stats.ratio_interval(a, b)
    assert 1.5 < low <= 2.0 <= high < 2.7


def test_ragged_block_times_are_refused():
    with pytest.raises(ValueError, match="one list per round"):
        bench_stats.ratio_interval([[1.0, 2.0], [1.0]], [[1.0, 1.0]] * 2)
