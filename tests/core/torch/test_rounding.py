"""Tests for kmp.core.torch.rounding: stochastic rounding's counter-based
hash, against the same stream written in Python integers
(`tests/support/hash_stream.py`) that JAX's is checked against: the same
seed gives the same bits on torch and JAX."""

import numpy as np
import pytest

from tests.support import hash_stream

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 1, 2**63 - 1])
def test_the_keys_and_bits_are_the_hash_of_seed_step_index_and_place(seed):
    import torch

    from kmp.core.torch import rounding

    for step, index in [(0, 0), (1, 0), (5, 3), (2**31 - 1, 17)]:
        key = rounding.step_seed(rounding.seed_value(seed), step, index)
        assert key.tolist() == hash_stream.key(seed, step, index)
        bits = rounding.random_bits(key, torch.zeros(3, 5), part=100)
        assert bits.shape == (3, 5) and bits.dtype == torch.int32
        want = hash_stream.bits(key.tolist(), range(100, 115))
        np.testing.assert_array_equal(bits.numpy().ravel(), want)
