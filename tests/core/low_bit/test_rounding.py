"""Tests for kmp.core.low_bit.rounding: stochastic rounding and its random
streams.

On every backend: rounding is unbiased, keeps representable and special
values, is the same for the same seed (compiled or not) and differs for
another; each backend's stream is keyed by seed, step and variable, and a
seed saved on one backend reads the same on another.
"""

import keras
import numpy as np
import pytest

from kmp.core.low_bit import rounding
from kmp.core.low_precision import streams as backend_streams
from tests.support import backends
from tests.support.backends import MODES
from tests.support.low_precision import compiled
from tests.support.low_precision import numpy_of

ops = keras.ops


def stochastic_round(value, dtype, seed):
    """`rounding.stochastic_round` with this backend's stream."""
    return rounding.stochastic_round(value, dtype, seed, backend_streams())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased(dtype, fraction, sign):
    low = np.float32(1.5)
    gap = np.float32(2.0**-7 if dtype == "bfloat16" else 2.0**-10)
    value = sign * (low + np.float32(fraction) * gap)
    count = 200_000
    rounded = stochastic_round(ops.full([count], value), dtype, [7, 11])
    rounded = numpy_of(ops.cast(rounded, "float32"), "float64")
    results = set(np.abs(rounded).tolist())
    assert results <= {float(low), float(low + gap)}
    up = np.mean(np.abs(rounded) > low)
    # Seeded, so never flaky; 6 standard deviations of the mean.
    assert abs(up - fraction) < 6 * np.sqrt(fraction * (1 - fraction) / count)


def test_stochastic_rounding_keeps_representable_and_special_values():
    values = backends.tensor(
        [0.0, -0.0, 1.0, -2.5, 3.0e38, np.inf, -np.inf, np.nan, 1e-40]
    )
    exact = ops.cast(ops.cast(values, "bfloat16"), "float32")
    for seed in range(5):
        rounded = stochastic_round(exact, "bfloat16", [seed, 0])
        rounded = numpy_of(ops.cast(rounded, "float32"))
        np.testing.assert_array_equal(rounded, numpy_of(exact))
        assert np.signbit(rounded[1])


@pytest.mark.parametrize("mode", MODES)
def test_stochastic_rounding_is_reproducible_from_its_seed(mode):
    values = np.random.default_rng(2).normal(size=(33, 5))
    values = backends.tensor(values)

    def round_with(seed):
        return stochastic_round(values, "bfloat16", seed)

    def rounded(function, seed):
        seed = ops.convert_to_tensor(np.array(seed, "int32"))
        return numpy_of(ops.cast(function(seed), "float32"))

    in_mode = compiled(round_with, mode)
    first = rounded(round_with, [1, 2])
    np.testing.assert_array_equal(rounded(in_mode, [1, 2]), first)
    assert not np.array_equal(rounded(round_with, [1, 3]), first)
    assert not np.array_equal(rounded(round_with, [2, 2]), first)


def test_the_stream_is_keyed_by_seed_step_and_variable():
    streams = backend_streams()
    seed = ops.convert_to_tensor(streams.seed_value(2**40 + 5))

    def key(seed, step, index):
        value = streams.step_seed(seed, ops.convert_to_tensor(step), index)
        return np.asarray(ops.convert_to_numpy(value)).tolist()

    first = key(seed, 3, 1)
    assert key(seed, 3, 1) == first
    other_seed = ops.convert_to_tensor(streams.seed_value(2**40 + 6))
    others = [key(seed, 4, 1), key(seed, 3, 2), key(other_seed, 3, 1)]
    assert all(other != first for other in others)
    assert streams.seed_of(streams.seed_value(2**63 - 1)) == 2**63 - 1


@pytest.mark.parametrize("seed", [0, 5, 2**32 - 1, 2**40 + 3, 2**63 - 1])
def test_a_seed_saved_on_any_backend_reads_the_same(seed):
    words = np.array([seed >> 32, seed & 0xFFFFFFFF], "uint32")
    assert rounding.seed_of_saved(np.int64(seed)) == seed  # TF, torch
    assert rounding.seed_of_saved(words) == seed  # JAX
    assert rounding.seed_of_saved(words.view("int32")) == seed
    streams = backend_streams()
    assert streams.seed_of(streams.seed_value(seed)) == seed
