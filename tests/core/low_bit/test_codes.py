"""Tests for kmp.core.low_bit.codes: the 8-bit dynamic code, the 4-bit code and
float8_e4m3fn, each value finding its nearest code.

Checked against references written here in NumPy (a search of the table;
ml_dtypes' cast to float8_e4m3fn, the one JAX and TensorFlow use), on
every backend, and torch's own forms against the shared one.
"""

import keras
import ml_dtypes
import numpy as np
import pytest

from kmp.core.low_bit import codes

ops = keras.ops


def _spread(size, seed, decades=9):
    """Values in [-1, 1] over `decades` decades, with the edges."""
    rng = np.random.default_rng(seed)
    value = rng.uniform(-1, 1, size=size) * 10.0 ** -rng.integers(
        0, decades, size=size
    )
    edges = [0.0, 1.0, -1.0, 1e-30, -1e-30, 0.99999, 2.0**-9 / 448]
    return np.concatenate([value, edges]).astype(np.float32)


def _numpy_nearest(value, table):
    table = np.asarray(table, np.float64)
    return np.abs(value.astype(np.float64)[:, None] - table).argmin(axis=1)


def test_every_value_is_written_within_half_its_bin():
    # Each code is its bin's centre: the error is at most half a bin,
    # 0.9 / count of the decade (e.g. 0.0035 in the top unsigned one).
    rng = np.random.default_rng(5)
    for signed in (True, False):
        low = -1.0 if signed else 0.0
        value = rng.uniform(low, 1.0, size=4096).astype(np.float32)
        value *= 10.0 ** -rng.integers(0, 7, size=4096)
        found = ops.convert_to_numpy(
            codes.nearest_dynamic(ops.convert_to_tensor(value), signed)
        )
        back = codes.dynamic_code(signed)[found]
        magnitude = np.abs(value)
        decade = np.clip(np.floor(-np.log10(magnitude)), 0, 6)
        count = 2.0 ** (6 - decade + (0 if signed else 1))
        half_bin = 0.45 / count * 10.0**-decade
        bound = np.where(magnitude < 1e-7, 1e-7, half_bin * 1.001 + 1e-9)
        assert np.all(np.abs(back - value) <= bound)


def test_the_code_has_256_sorted_values_with_0_and_1_exact():
    for signed in (True, False):
        table = codes.dynamic_code(signed)
        assert table.dtype == np.float32 and table.shape == (256,)
        assert np.all(np.diff(table) > 0)
        assert 0.0 in table and table[-1] == 1.0
        assert table[codes.CODES["8bit"].zero(signed)] == 0.0
    unsigned = codes.dynamic_code(False)
    assert unsigned[0] == 0.0 and unsigned[1] < 1e-6
    # Half of the unsigned values are in the top decade, a quarter in the
    # next: a float's exponent and mantissa, in decades.
    assert np.sum(unsigned > 0.1) == 128 + 1
    assert np.sum((unsigned > 0.01) & (unsigned < 0.1)) == 64
    signed = codes.dynamic_code(True)
    np.testing.assert_array_equal(
        signed[signed < 0], -signed[(signed > 0) & (signed < 1)][::-1]
    )


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
            torch_low_precision.nearest_code(
                ops.convert_to_tensor(v), signed, codes.CODES["8bit"]
            )
        )
        want = ops.convert_to_numpy(
            codes.nearest_dynamic(ops.convert_to_tensor(v), signed)
        )
        table = codes.dynamic_code(signed).astype(np.float64)
        # The same code, or one as near (a value on a midpoint).
        np.testing.assert_allclose(
            np.abs(v - table[got]), np.abs(v - table[want]), rtol=0, atol=1e-7
        )
        assert np.mean(got == want) > 0.9999


def test_the_4bit_code_is_16_sorted_values_with_0_and_1():
    for signed, size in ((True, 15), (False, 16)):
        table = codes.log_code(signed)
        assert table.dtype == np.float32 and table.shape == (size,)
        assert np.all(np.diff(table) > 0) and table[-1] == 1.0
        assert table[codes.CODES["4bit"].zero(signed)] == 0.0
        ratios = table[table > 0][1:] / table[table > 0][:-1]
        np.testing.assert_allclose(ratios, ratios[0], rtol=1e-5)
    assert codes.log_code(False)[1] == np.float32(1e-4)
    assert codes.log_code(True)[0] == -1.0


@pytest.mark.parametrize("signed", [True, False])
def test_the_4bit_code_nearest_is_a_searchs(signed):
    value = _spread(20_000, 3, decades=6)
    value = value if signed else np.abs(value)
    table = codes.log_code(signed)
    got = ops.convert_to_numpy(
        codes.nearest_log(ops.convert_to_tensor(value), signed)
    )
    want = _numpy_nearest(value, table)
    assert got.min() >= 0 and got.max() < 16
    # The same code, or one as near (a value on a midpoint).
    np.testing.assert_allclose(
        np.abs(value - table[got]), np.abs(value - table[want]), atol=1e-7
    )


def test_the_float8_code_is_float8_e4m3fns_values():
    table = codes.float8_code()
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    want = want.astype(np.float32) / np.float32(448)
    np.testing.assert_array_equal(table, want)  # NaN where it is NaN.
    assert np.isnan(table[[0x7F, 0xFF]]).all()
    assert table[0x7E] == 1.0 and codes.CODES["float8"].zero(True) == 0


def test_the_float8_nearest_is_a_cast_to_float8():
    value = _spread(50_000, 4)
    got = ops.convert_to_numpy(
        codes.nearest_float8(ops.convert_to_tensor(value))
    )
    scaled = value * np.float32(codes.FLOAT8_MAX)
    want = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    # Bit for bit, but that -0.0 itself is written as +0.0.
    negative_zero = want == 0x80
    np.testing.assert_array_equal(got[~negative_zero], want[~negative_zero])
    assert set(got[negative_zero].tolist()) <= {0, 0x80}


@pytest.mark.torch
@pytest.mark.parametrize("name", ["4bit", "float8"])
def test_torchs_forms_find_the_shared_forms_codes(name):
    from kmp.core.torch import low_precision as torch_low_precision

    code = codes.CODES[name]
    value = _spread(50_000, 8)
    for signed in (True, False):
        v = value if signed else np.abs(value)
        tensor = ops.convert_to_tensor(v)
        got = ops.convert_to_numpy(
            torch_low_precision.nearest_code(tensor, signed, code)
        )
        want = ops.convert_to_numpy(codes.nearest(tensor, signed, code))
        table = code.table(signed).astype(np.float64)
        np.testing.assert_array_equal(table[got], table[want])


def _midpoint_sweep(signed):
    """Values at and one float32 step either side of every midpoint
    between the 8-bit code's values, and a spread over nine decades."""
    table = codes.dynamic_code(signed).astype(np.float64)
    midpoints = ((table[1:] + table[:-1]) / 2).astype(np.float32)
    near = [
        midpoints,
        np.nextafter(midpoints, np.float32(2)),
        np.nextafter(midpoints, np.float32(-2)),
    ]
    value = np.concatenate([*near, _spread(100_000, 9)])
    return value if signed else np.abs(value)


@pytest.mark.parametrize("signed", [True, False])
def test_the_8bit_look_up_finds_the_nearest_code(signed):
    # The look-up (the 8-bit code's form on every backend) against a
    # search of the table: the nearest code, or on a midpoint one as near;
    # and the elementwise form's code but where two are as near.
    value = _midpoint_sweep(signed)
    tensor = ops.convert_to_tensor(value)
    got = ops.convert_to_numpy(codes.nearest_lookup(tensor, signed))
    table = codes.dynamic_code(signed).astype(np.float64)
    clipped = np.clip(value, -1.0, 1.0).astype(np.float64)
    want = _numpy_nearest(clipped.astype(np.float32), table)
    assert got.min() >= 0 and got.max() <= 255
    np.testing.assert_allclose(
        np.abs(clipped - table[got]), np.abs(clipped - table[want]), atol=1e-7
    )
    elementwise = ops.convert_to_numpy(codes.nearest_dynamic(tensor, signed))
    tied = (
        np.abs(
            np.abs(clipped - table[got]) - np.abs(clipped - table[elementwise])
        )
        <= 1e-7
    )
    assert np.all((got == elementwise) | tied)
    assert codes.CODES["8bit"].find is codes.nearest_lookup


@pytest.mark.jax
@pytest.mark.parametrize("signed", [True, False])
def test_jaxs_look_up_writes_the_shared_look_ups_bytes(signed):
    # JAX's form reads the table in a loop of its own (16-bit keys, a
    # clamping gather): the same bytes, jitted as the update runs it, for
    # the midpoints, their neighbours, values past 1 and infinities.
    import jax

    from kmp.core.jax import low_precision as jax_low_precision

    value = np.concatenate(
        [_midpoint_sweep(signed), [1.5, 3e38, np.inf, 0.0, 1.0]]
    ).astype(np.float32)
    if signed:
        value = np.concatenate([value, [-1.5, -np.inf, -1.0]])
    code = codes.CODES["8bit"]
    got = jax.jit(lambda v: jax_low_precision.nearest_code(v, signed, code))(
        value
    )
    want = codes.nearest_lookup(ops.convert_to_tensor(value), signed)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(
        np.asarray(got), ops.convert_to_numpy(want).astype(np.uint8)
    )


def test_the_look_up_table_holds_each_keys_candidate_and_split():
    # One int32 per key of [0, 1]: the candidate above 16 bits, the split's
    # bits below the key under them (2**15: none), as `code_tables` has
    # them; and a value just past a split takes the next code.
    for signed in (True, False):
        table = codes.lookup_table(signed)
        assert table.dtype == np.int32
        table = table.astype(np.int64)
        candidates, splits = codes.code_tables(signed)
        last = int(np.float32(1.0).view(np.int32)) >> codes.DROPPED_BITS
        assert len(table) == last + 1
        np.testing.assert_array_equal(table >> 16, candidates[: last + 1])
        assert table[-1] >> 16 == 255  # 1.0's code, the last.
        low = table & 0xFFFF
        has_split = low < 2**15
        keys = np.arange(last + 1)
        rebuilt = (keys[has_split] << codes.DROPPED_BITS) | low[has_split]
        np.testing.assert_array_equal(
            rebuilt.astype(np.int32).view(np.float32),
            splits[: last + 1][has_split],
        )
        # No split: none in the key's range, or one rounded onto the next
        # key's first value (past every value of this key).
        rest = splits[: last + 1][~has_split]
        with np.errstate(invalid="ignore"):
            rest_keys = rest.view(np.int32) >> codes.DROPPED_BITS
        past = rest_keys > keys[~has_split]
        assert np.all(~np.isfinite(rest) | past)
        above = np.nextafter(splits[: last + 1][has_split], np.float32(2))
        found = ops.convert_to_numpy(
            codes.nearest_lookup(ops.convert_to_tensor(above), signed)
        )
        np.testing.assert_array_equal(found, candidates[keys[has_split]] + 1)


def _cast_bytes(normalized):
    # JAX's own cast to float8_e4m3fn, read as its bytes (-0.0 as +0.0's,
    # as `nearest_float8` writes it): the reference. (XLA's CPU backend
    # converts in software, more than twice as slow as the bits' form;
    # TensorFlow's bitcast refuses float8.)
    y = ops.clip(normalized, -1.0, 1.0) * codes.FLOAT8_MAX
    y = ops.where(y == 0.0, ops.zeros_like(y), y)
    return ops.cast(ops.view(ops.cast(y, "float8_e4m3fn"), "uint8"), "int32")


@pytest.mark.jax
def test_float8_from_the_floats_bits_is_the_casts_bytes():
    # Every float8 value and the midpoints between neighbours (ties go to
    # the even byte) and a float32 step either side, -0.0, values past 1
    # and float32s of every exponent (one in 4099 of those in [0, 1]):
    # JAX's cast's bytes are `nearest_float8`'s, bit for bit.
    table = codes.float8_code()
    finite = np.sort(table[np.isfinite(table)]).astype(np.float64)
    midpoints = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
    one = int(np.float32(1).view(np.int32))
    every = np.arange(0, one + 1, 4099, dtype=np.int32).view(np.float32)
    value = np.concatenate(
        [
            finite.astype(np.float32),
            midpoints,
            np.nextafter(midpoints, np.float32(2)),
            np.nextafter(midpoints, np.float32(-2)),
            np.float32([-0.0, 0.0, 1.5, -3.0, 1e-30, -1e-30]),
            _spread(50_000, 11),
            every,
            -every,
        ]
    )
    tensor = ops.convert_to_tensor(value)
    got = ops.convert_to_numpy(_cast_bytes(tensor))
    want = ops.convert_to_numpy(codes.nearest_float8(tensor))
    np.testing.assert_array_equal(got, want)
