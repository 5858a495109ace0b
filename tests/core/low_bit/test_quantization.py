"""Tests for kmp.core.low_bit.quantization: block-wise codes with a scale per
block.

Checked against a NumPy reference written here, for every code (8-bit,
4-bit, float8): per-block scales with padding, the nearest code of each
value, two 4-bit codes to a byte, the relative error the 8-bit code
promises over seven decades, the root for non-negative slots, and the
same codes on every backend (the reference is backend-free).
"""

import keras
import numpy as np
import pytest

from kmp.core.low_bit import codes
from kmp.core.low_bit import quantization as q

ops = keras.ops
EIGHT = codes.CODES["8bit"]


def _numpy_quantize(value, code, signed, block_size):
    """`(codes, scales)`: unpacked codes, a search of the table."""
    flat = np.asarray(value, np.float32).reshape(-1)
    count = -(-flat.size // block_size)
    grid = np.zeros(count * block_size, np.float32)
    grid[: flat.size] = flat
    grid = grid.reshape(count, block_size)
    scales = np.abs(grid).max(axis=1)
    normalized = grid / np.where(scales > 0, scales, 1)[:, None]
    table = np.nan_to_num(code.table(signed).astype(np.float64), nan=9.0)
    distance = np.abs(normalized.reshape(-1)[:, None] - table)
    return distance.argmin(axis=1), scales.astype(np.float32)


def _unpacked(data, code):
    data = np.asarray(data).astype(np.int64)
    if code.bits == 4:
        return np.stack([data // 16, data % 16], axis=1).reshape(-1)
    return data


@pytest.mark.parametrize("name", list(codes.CODES))
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape, block_size", [((7, 9), 16), ((300,), 256)])
def test_codes_are_the_nearest_as_a_search_finds_them(
    name, signed, shape, block_size
):
    code = codes.CODES[name]
    rng = np.random.default_rng(0)
    value = rng.normal(size=shape) * 10 ** rng.uniform(-5, 1, size=shape)
    value = value.astype(np.float32)
    if not signed:
        value = np.abs(value)
    data, scales = q.quantize(
        ops.convert_to_tensor(value), code, signed, block_size
    )
    want_codes, want_scales = _numpy_quantize(value, code, signed, block_size)
    np.testing.assert_array_equal(ops.convert_to_numpy(scales), want_scales)
    data = ops.convert_to_numpy(data)
    padded = want_codes.size
    assert data.dtype == np.uint8
    assert data.shape == (q.byte_count(padded, code),)
    got = _unpacked(data, code)
    # The nearest code; a value halfway may go either way (float rounding
    # of the midpoints), so compare the values the codes stand for.
    table = code.table(signed)
    np.testing.assert_allclose(table[got], table[want_codes], rtol=0, atol=2e-3)
    assert np.mean(table[got] == table[want_codes]) > 0.99
    back = ops.convert_to_numpy(
        q.dequantize(data, scales, code, signed, shape, block_size)
    )
    assert back.shape == shape and back.dtype == np.float32
    np.testing.assert_array_equal(
        back.reshape(-1),
        (table[got].reshape(-1, block_size) * want_scales[:, None]).reshape(-1)[
            : value.size
        ],
    )


def test_two_4bit_codes_share_a_byte_the_first_in_the_high_half():
    code = codes.CODES["4bit"]
    unpacked = ops.convert_to_tensor(np.array([1, 2, 15, 0, 7, 7], np.int32))
    data = q.pack(unpacked, code)
    assert ops.convert_to_numpy(data).tolist() == [0x12, 0xF0, 0x77]
    back = ops.convert_to_numpy(q.unpack(data, code))
    assert back.tolist() == [1, 2, 15, 0, 7, 7]
    assert q.byte_count(256, code) == 128 and q.byte_count(256, EIGHT) == 256
    # A new slot reads as zeros: both halves of its bytes are 0's code.
    assert q.zero_byte(code, True) == 0x77 and q.zero_byte(code, False) == 0
    assert q.zero_byte(EIGHT, True) == EIGHT.zero(True)


def test_relative_error_within_the_codes_precision_over_seven_decades():
    # Each block holds values of one decade below its largest: the top
    # decade's step is 0.9/128 (unsigned), so an error of at most half of
    # it relative to 0.1, 3.5%; the lowest decade's, 45%.
    for decade, bound in [(0, 0.036), (1, 0.071), (3, 0.29)]:
        rng = np.random.default_rng(decade)
        value = 10.0**-decade * rng.uniform(0.1, 1.0, size=255)
        value = np.concatenate([[1.0], value]).astype(np.float32)
        data, scales = q.quantize(
            ops.convert_to_tensor(value), EIGHT, False, 256
        )
        back = ops.convert_to_numpy(
            q.dequantize(data, scales, EIGHT, False, (256,), 256)
        )
        error = np.abs(back - value) / value
        assert error.max() <= bound, (decade, error.max())


@pytest.mark.parametrize("name", list(codes.CODES))
def test_a_block_of_zeros_and_zero_padding_read_as_zeros(name):
    code = codes.CODES[name]
    value = np.zeros((40,), np.float32)
    value[:8] = [1, -2, 3, -4, 0, 0, 0.5, 7]
    data, scales = q.quantize(ops.convert_to_tensor(value), code, True, 16)
    scales = ops.convert_to_numpy(scales)
    assert scales.tolist() == [7.0, 0.0, 0.0]
    back = q.dequantize(data, scales, code, True, (40,), 16)
    back = ops.convert_to_numpy(back)
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
    data, scales = q.quantize(slot_value, EIGHT, False, 4)
    back = q.dequantize(data, scales, EIGHT, False, (4,), 4)
    back = ops.convert_to_numpy(q.decode(back, "velocity"))
    assert back[1] > 0 and back[3] == 0
    np.testing.assert_allclose(back[:3], value[:3], rtol=0.6)
    momentum = ops.convert_to_tensor(np.array([-1.0, 2.0], np.float32))
    assert q.encode(momentum, "momentum") is momentum
    assert q.is_signed("momentum") and not q.is_signed("velocity_hat")


@pytest.mark.parametrize("name", list(codes.CODES))
@pytest.mark.parametrize(
    "shape, block_size, rows",
    [
        ((6, 64), 32, 1),  # Two blocks a row.
        ((3, 4, 64), 64, 1),  # A block a row, on a rank-3 variable.
        ((8, 16), 32, 2),  # A block of two rows.
        ((512,), 128, 1),  # A vector of whole blocks.
    ],
)
def test_shaped_storage_holds_the_flat_blocks_in_the_variables_axes(
    name, shape, block_size, rows
):
    code = codes.CODES[name]
    storage = q.storage(shape, block_size, code)
    assert storage.rows == rows
    assert storage.codes == (*shape[:-1], shape[-1] // code.per_byte)
    rng = np.random.default_rng(1)
    value = ops.convert_to_tensor(rng.normal(size=shape).astype("float32"))
    flat_codes, flat_scales = q.quantize(value, code, True, block_size)
    data, scales = q.quantize_shaped(value, code, True, storage)
    assert tuple(scales.shape) == storage.scales
    # The same bytes and scales as the flat blocks', reshaped.
    np.testing.assert_array_equal(
        ops.convert_to_numpy(data).reshape(-1),
        ops.convert_to_numpy(flat_codes),
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(scales).reshape(-1),
        ops.convert_to_numpy(flat_scales),
    )
    back = q.dequantize_shaped(data, scales, code, True, storage)
    flat_back = q.dequantize(
        flat_codes, flat_scales, code, True, shape, block_size
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(back), ops.convert_to_numpy(flat_back)
    )


@pytest.mark.parametrize(
    "shape, name",
    [
        ((16, 300), "8bit"),  # 300 columns: blocks of 256 run across rows.
        ((10, 64), "8bit"),  # Blocks of 4 rows, and 10 rows.
        ((4096, 3), "4bit"),  # Odd columns: 4-bit pairs run across rows.
        ((300,), "8bit"),  # A last, shorter block: padded.
    ],
)
def test_shapes_whose_blocks_do_not_tile_their_rows_stay_flat(shape, name):
    code = codes.CODES[name]
    assert q.storage(shape, code.block_size, code) is None
