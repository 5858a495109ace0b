"""Tests for kmp.core.jax.rounding: stochastic rounding's counter-based hash.

Each element's 16 bits are the top half of lowbias32 of its place and a
key; the key hashes (seed, step, variable index). Checked against the hash
written in Python integers (`tests/support/hash_stream.py`, which torch's
stream is checked against too), for uniform bits, for parts that get
the bits of their place in the whole, and for a rounding that trains as
round-to-nearest-with-compensation does.
"""

import keras
import numpy as np
import pytest

import kmp
from tests.support import hash_stream

pytestmark = pytest.mark.jax


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 1, 2**63 - 1])
def test_the_keys_and_bits_are_the_hash_of_seed_step_index_and_place(seed):
    from kmp.core.jax import rounding

    for step, index in [(0, 0), (1, 0), (5, 3), (2**31 - 1, 17)]:
        key = rounding.step_seed(rounding.seed_value(seed), step, index)
        key = np.asarray(key).tolist()
        assert key == hash_stream.key(seed, step, index)
        words = np.array(key, "uint32")
        bits = rounding.random_bits(words, np.zeros((3, 5)), part=None)
        assert bits.shape == (3, 5) and str(bits.dtype) == "int32"
        assert np.asarray(bits).ravel().tolist() == hash_stream.bits(
            key, range(15)
        )


def test_a_part_gets_the_bits_of_its_place_in_the_whole():
    import jax

    from kmp.core.jax import rounding

    key = rounding.step_seed(rounding.seed_value(3), 4, 1)
    whole = np.asarray(rounding.random_bits(key, np.zeros(4096)))
    for start in (0, 1, 1000, 4000):
        part = jax.jit(rounding.random_bits)(key, np.zeros(96), start)
        np.testing.assert_array_equal(part, whole[start : start + 96])


def test_the_bits_are_uniform_and_independent():
    from kmp.core.jax import rounding

    key = rounding.step_seed(rounding.seed_value(11), 1, 0)
    n = 2**18
    bits = np.asarray(rounding.random_bits(key, np.zeros(n))).astype(np.int64)
    assert bits.min() >= 0 and bits.max() < 2**16
    # Each of the 16 bits is set half the time (5 standard deviations).
    for bit in range(16):
        ones = np.sum((bits >> bit) & 1)
        assert abs(ones - n / 2) < 5 * np.sqrt(n / 4), bit
    # The top 8 bits' 256 values, equally often (chi-square, 255 degrees
    # of freedom: mean 255, standard deviation 22.6; 380 is 5.5 of them).
    counts = np.bincount(bits >> 8, minlength=256)
    expected = n / 256
    assert np.sum((counts - expected) ** 2 / expected) < 380
    # Neighbours, and the same places under the next key, uncorrelated.
    centred = bits - bits.mean()
    scale = np.sum(centred**2)
    assert abs(np.sum(centred[1:] * centred[:-1])) / scale < 0.01
    other = rounding.step_seed(rounding.seed_value(11), 2, 0)
    again = np.asarray(rounding.random_bits(other, np.zeros(n))).astype(float)
    assert abs(np.corrcoef(bits, again)[0, 1]) < 0.01


def test_stochastic_rounding_trains_as_kahan_does():
    # bfloat16 weights, 8-bit state: stochastic rounding (this hash) and
    # Kahan summation end a short regression within a few percent of each
    # other, and of float32 AdamW.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 64)).astype("float32")
    y = x @ rng.normal(size=(64, 1)).astype("float32") * 0.1

    def final_loss(policy, rounding):
        keras.utils.set_random_seed(1)
        with kmp.policy_scope(policy):
            model = keras.Sequential(
                [keras.Input((64,)), keras.layers.Dense(1, dtype=policy)]
            )
        optimizer = keras.optimizers.AdamW(1e-2)
        if rounding:
            optimizer = kmp.LowPrecisionOptimizer(
                optimizer, rounding, slot_dtype="8bit", seed=5
            )
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(x, y, batch_size=64, epochs=8, verbose=0)
        return history.history["loss"][-1]

    reference = final_loss("float32", None)
    stochastic = final_loss("bfloat16", "stochastic")
    kahan = final_loss("bfloat16", "kahan")
    first = 0.1**2 * 64  # The loss before training, about.
    assert stochastic < 0.05 * first
    assert abs(stochastic - kahan) < 0.2 * max(kahan, reference) + 1e-4
