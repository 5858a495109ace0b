"""Tests for kmp.core.quantization: the dynamic code and block-wise 8 bits.

Checked against a NumPy reference written here: the code's values, the
nearest-code rounding, per-block scales with padding, the relative error
the code promises over seven decades, the root for non-negative slots,
and the same codes on every backend (the reference is backend-free).
"""

import keras
import numpy as np
import pytest

from kmp.core import quantization as q

ops = keras.ops


def _numpy_quantize(value, signed, block_size):
    flat = np.asarray(value, np.float32).reshape(-1)
    count = -(-flat.size // block_size)
    grid = np.zeros(count * block_size, np.float32)
    grid[: flat.size] = flat
    grid = grid.reshape(count, block_size)
    scales = np.abs(grid).max(axis=1)
    normalized = grid / np.where(scales > 0, scales, 1)[:, None]
    table = q.dynamic_code(signed).astype(np.float64)
    distance = np.abs(normalized.reshape(-1)[:, None] - table)
    return distance.argmin(axis=1).astype(np.uint8), scales.astype(np.float32)


def _normalized(value, block_size):
    flat = np.asarray(value, np.float32).reshape(-1)
    count = -(-flat.size // block_size)
    grid = np.zeros(count * block_size, np.float32)
    grid[: flat.size] = flat
    grid = grid.reshape(count, block_size)
    scales = np.abs(grid).max(axis=1)
    return (grid / np.where(scales > 0, scales, 1)[:, None]).reshape(-1)


def test_every_value_is_written_within_half_its_bin():
    # Each code is its bin's centre: the error is at most half a bin,
    # 0.9 / count of the decade (e.g. 0.0035 in the top unsigned one).
    rng = np.random.default_rng(5)
    for signed in (True, False):
        low = -1.0 if signed else 0.0
        value = rng.uniform(low, 1.0, size=4096).astype(np.float32)
        value *= 10.0 ** -rng.integers(0, 7, size=4096)
        codes = ops.convert_to_numpy(
            q.nearest_code(ops.convert_to_tensor(value), signed)
        )
        back = q.dynamic_code(signed)[codes]
        magnitude = np.abs(value)
        decade = np.clip(np.floor(-np.log10(magnitude)), 0, 6)
        count = 2.0 ** (6 - decade + (0 if signed else 1))
        half_bin = 0.45 / count * 10.0**-decade
        bound = np.where(magnitude < 1e-7, 1e-7, half_bin * 1.001 + 1e-9)
        assert np.all(np.abs(back - value) <= bound)


def test_the_code_has_256_sorted_values_with_0_and_1_exact():
    for signed in (True, False):
        table = q.dynamic_code(signed)
        assert table.dtype == np.float32 and table.shape == (256,)
        assert np.all(np.diff(table) > 0)
        assert 0.0 in table and table[-1] == 1.0
        assert table[q.zero_code(signed)] == 0.0
    unsigned = q.dynamic_code(False)
    assert unsigned[0] == 0.0 and unsigned[1] < 1e-6
    # Half of the unsigned values are in the top decade, a quarter in the
    # next: a float's exponent and mantissa, in decades.
    assert np.sum(unsigned > 0.1) == 128 + 1
    assert np.sum((unsigned > 0.01) & (unsigned < 0.1)) == 64
    signed = q.dynamic_code(True)
    np.testing.assert_array_equal(
        signed[signed < 0], -signed[(signed > 0) & (signed < 1)][::-1]
    )


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape, block_size", [((7, 9), 16), ((300,), 256)])
def test_codes_are_the_nearest_as_a_search_finds_them(
    signed, shape, block_size
):
    rng = np.random.default_rng(0)
    value = rng.normal(size=shape) * 10 ** rng.uniform(-5, 1, size=shape)
    value = value.astype(np.float32)
    if not signed:
        value = np.abs(value)
    codes, scales = q.quantize(ops.convert_to_tensor(value), signed, block_size)
    want_codes, want_scales = _numpy_quantize(value, signed, block_size)
    np.testing.assert_array_equal(ops.convert_to_numpy(scales), want_scales)
    got = ops.convert_to_numpy(codes)
    assert got.dtype == np.uint8 and got.shape == want_codes.shape
    # The nearest code; a value halfway may go either way (float rounding
    # of the midpoints), so compare the values the codes stand for.
    table = q.dynamic_code(signed)
    np.testing.assert_allclose(table[got], table[want_codes], rtol=0, atol=2e-3)
    assert np.mean(got == want_codes) > 0.99
    back = ops.convert_to_numpy(
        q.dequantize(codes, scales, signed, shape, block_size)
    )
    assert back.shape == shape and back.dtype == np.float32
    np.testing.assert_array_equal(
        back.reshape(-1),
        (table[got].reshape(-1, block_size) * want_scales[:, None]).reshape(-1)[
            : value.size
        ],
    )


def test_relative_error_within_the_codes_precision_over_seven_decades():
    # Each block holds values of one decade below its largest: the top
    # decade's step is 0.9/128 (unsigned), so an error of at most half of
    # it relative to 0.1, 3.5%; the lowest decade's, 45%.
    for decade, bound in [(0, 0.036), (1, 0.071), (3, 0.29)]:
        rng = np.random.default_rng(decade)
        value = 10.0**-decade * rng.uniform(0.1, 1.0, size=255)
        value = np.concatenate([[1.0], value]).astype(np.float32)
        codes, scales = q.quantize(ops.convert_to_tensor(value), False, 256)
        back = ops.convert_to_numpy(
            q.dequantize(codes, scales, False, (256,), 256)
        )
        error = np.abs(back - value) / value
        assert error.max() <= bound, (decade, error.max())


def test_a_block_of_zeros_and_zero_padding_read_as_zeros():
    value = np.zeros((40,), np.float32)
    value[:8] = [1, -2, 3, -4, 0, 0, 0.5, 7]
    codes, scales = q.quantize(ops.convert_to_tensor(value), True, 16)
    scales = ops.convert_to_numpy(scales)
    assert scales.tolist() == [7.0, 0.0, 0.0]
    back = ops.convert_to_numpy(q.dequantize(codes, scales, True, (40,), 16))
    assert np.all(back[8:] == 0) and back[7] == 7.0
    assert q.blocks(40, 16) == 3 and q.blocks(1, 256) == 1


def test_a_non_negative_slot_is_kept_as_its_root():
    # A second moment 1e-10 below its block's largest would read as 0 on
    # the code itself (seven decades); on the root it is five decades down.
    value = np.array([1.0, 1e-10, 4e-6, 0.0], np.float32)
    slot_value = q.encode(ops.convert_to_tensor(value), "velocity")
    np.testing.assert_allclose(
        ops.convert_to_numpy(slot_value), np.sqrt(value), rtol=1e-6
    )
    codes, scales = q.quantize(slot_value, False, 4)
    back = q.decode(q.dequantize(codes, scales, False, (4,), 4), "velocity")
    back = ops.convert_to_numpy(back)
    assert back[1] > 0 and back[3] == 0
    np.testing.assert_allclose(back[:3], value[:3], rtol=0.6)
    momentum = ops.convert_to_tensor(np.array([-1.0, 2.0], np.float32))
    assert q.encode(momentum, "momentum") is momentum
    assert q.is_signed("momentum") and not q.is_signed("velocity_hat")


@pytest.mark.torch
def test_torchs_look_up_finds_the_same_nearest_codes():
    from kmp.core.torch import low_precision as torch_low_precision

    rng = np.random.default_rng(7)
    value = rng.uniform(-1, 1, size=50_000) * 10.0 ** -rng.integers(
        0, 9, size=50_000
    )
    value = np.concatenate([value, [0.0, 1.0, -1.0, 1e-30, 0.99999]])
    value = value.astype(np.float32)
    for signed in (True, False):
        v = value if signed else np.abs(value)
        got = ops.convert_to_numpy(
            torch_low_precision.nearest_code(ops.convert_to_tensor(v), signed)
        )
        want = ops.convert_to_numpy(
            q.nearest_code(ops.convert_to_tensor(v), signed)
        )
        table = q.dynamic_code(signed).astype(np.float64)
        # The same code, or one as near (a value on a midpoint).
        np.testing.assert_allclose(
            np.abs(v - table[got]), np.abs(v - table[want]), rtol=0, atol=1e-7
        )
        assert np.mean(got == want) > 0.9999
