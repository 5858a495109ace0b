"""8-bit optimizer state: block-wise quantization on a dynamic code.

An optimizer slot (Adam's moments, momentum) of `n` elements is kept as `n`
one-byte codes and one float32 scale per block of `block_size` elements,
as in bitsandbytes' 8-bit optimizers (Dettmers et al., "8-bit Optimizers
via Block-wise Quantization", ICLR 2022):

* a block's scale is its largest absolute value, so every block uses the
  whole code, and one outlier costs only its own block precision;
* a code is an index into a table of 256 values in [-1, 1] (signed) or
  [0, 1] (unsigned), the *dynamic code*: like a float, each decade below
  1 gets its own run of values, the top decade half of them, the next a
  quarter, down to 1e-6 (the table is built by `dynamic_code`). Relative
  precision is kept over seven decades, where a linear int8 code keeps
  two;
* a value is written as the code nearest to it (computed elementwise from
  its decade, not searched for: `nearest_code`) and read as
  `table[code] * scale`.

Slots whose values cannot be negative (Adam's second moment) use the
unsigned code on their square root: the second moment spans twice the
decades of the gradients it averages, and a value that fell to 0 while
the first moment did not would divide by epsilon alone. On the root, a
second moment reads as 0 only where the first moment does too.

Everything is `keras.ops`: the same arithmetic on every backend, inside
`jit`, `tf.function` and XLA. `kmp.core.low_precision` keeps the codes
and scales as the inner optimizer's variables and hands its update a
float32 view of them (`kmp.core.rounding.DequantizedView`,
`kmp.core.tensorflow.rounding.DequantizedView`).
"""

import dataclasses
import functools
import math

import numpy as np
from keras import ops

BLOCK_SIZE = 256  # Elements per scale (torchao's; bitsandbytes' 256-4096).
MIN_8BIT_SIZE = 4096  # Smaller variables keep their slots (bitsandbytes').
CODE_DTYPE = "uint8"
DECADES = 7  # 1 down to 1e-6.

# Slot names (Keras's `add_variable_from_reference` names) whose values
# are never negative: kept as the root on the unsigned code.
NON_NEGATIVE_SLOTS = ("velocity", "velocity_hat")


@functools.lru_cache(maxsize=None)
def dynamic_code(signed: bool) -> np.ndarray:
    """The 256 values of the code, sorted, float32, 0 and 1 exact.

    Decade `d` (values in [10**-(d+1), 10**-d], d = 0..6) gets `2**(7-d)`
    values (unsigned) or `2**(6-d)` on each side of 0 (signed), at the
    midpoints of equal steps across the decade: with 0 and 1, 256 values
    (signed: -1 is not one; the most negative is -0.993).

    >>> code = dynamic_code(signed=False)
    >>> len(code), float(code[0]), round(float(code[1]), 9), float(code[-1])
    (256, 0.0, 3.25e-07, 1.0)
    >>> signed = dynamic_code(signed=True)
    >>> len(signed), round(float(signed[0]), 3), float(signed[-1])
    (256, -0.993, 1.0)
    """
    extra = 0 if signed else 1
    below_one = []
    for decade in range(DECADES):
        count = 2 ** (DECADES - 1 - decade + extra)
        top = 10.0**-decade
        below_one += [
            top * (0.1 + (k + 0.5) * 0.9 / count) for k in range(count)
        ]
    below_one = np.array(below_one)
    parts = [[0.0], below_one, [1.0]]
    if signed:
        parts.append(-below_one)
    table = np.sort(np.concatenate(parts)).astype(np.float32)
    if table.shape != (256,) or len(np.unique(table)) != 256:
        raise AssertionError(f"not 256 distinct values: {table.shape}")
    return table


def zero_code(signed: bool) -> int:
    """The code of 0 (what a new slot's codes are filled with)."""
    return int(np.flatnonzero(dynamic_code(signed) == 0.0)[0])


def blocks(size: int, block_size: int) -> int:
    """The number of blocks of `size` elements."""
    return max(1, math.ceil(size / block_size))


def quantize(value, signed: bool, block_size: int, nearest=None):
    """`(codes, scales)` of a float32 tensor: `uint8` codes, flat and
    padded to whole blocks, and one float32 scale per block (the block's
    largest absolute value; 0 for a block of zeros).

    A value divided by its block's scale is written as the nearest code:
    `nearest(normalized, signed)`, `nearest_code` by default (computed,
    not searched for; each backend's package picks its fastest form).
    """
    flat = ops.reshape(ops.cast(value, "float32"), (-1,))
    size = flat.shape[0]
    count = blocks(size, block_size)
    padding = count * block_size - size
    if padding:
        flat = ops.pad(flat, [(0, padding)])
    grid = ops.reshape(flat, (count, block_size))
    scales = ops.max(ops.abs(grid), axis=1)
    divisor = ops.where(scales > 0, scales, ops.ones_like(scales))
    normalized = ops.reshape(grid / divisor[:, None], (-1,))
    nearest = nearest or nearest_code
    return ops.cast(nearest(normalized, signed), CODE_DTYPE), scales


def nearest_code(normalized, signed: bool):
    """The code (an int32 in [0, 255]) nearest to each value in [-1, 1],
    computed elementwise (no search, no gather: it fuses with the update).

    A value's decade `d` (values in [10**-(d+1), 10**-d)) comes from six
    comparisons, its bin `k` in the decade from the `count` equal steps
    the decade has (`dynamic_code`): each code is the centre of its bin, so
    within a decade the bin's code is the nearest; at a decade's edges the
    neighbouring decade's (or 0's, or 1's) code may be nearer, which two
    more comparisons check. The code's place among the non-negative ones
    is `count + k` (signed; 0 is 0, 1 is 128) or `count - 1 + k`
    (unsigned; 1 is 255); a negative value's is mirrored below 0's.
    """
    magnitude = ops.minimum(ops.abs(normalized), 1.0)
    decade = ops.zeros_like(magnitude)
    for d in range(1, DECADES):
        decade = decade + ops.cast(magnitude < 10.0**-d, magnitude.dtype)
    extra = 0 if signed else 1
    counts = [2.0 ** (DECADES - 1 - d + extra) for d in range(DECADES)]

    def per_decade(values):
        out = ops.full_like(magnitude, values[-1])
        for d in range(DECADES - 2, -1, -1):
            out = ops.where(decade == d, values[d], out)
        return out

    def centre(d, k):
        return 10.0**-d * (0.1 + (k + 0.5) * 0.9 / counts[d])

    tens = per_decade([10.0**d for d in range(DECADES)])
    count = per_decade(counts)
    step = ops.floor((magnitude * tens - 0.1) * count / 0.9)
    step = ops.clip(step, 0.0, count - 1.0)
    value = (0.1 + (step + 0.5) * 0.9 / count) / tens
    below = per_decade(
        [centre(d + 1, counts[d + 1] - 1) for d in range(DECADES - 1)] + [0.0]
    )
    above = per_decade([1.0] + [centre(d - 1, 0) for d in range(1, DECADES)])
    distance = ops.abs(magnitude - value)
    down = ops.logical_and(step == 0, ops.abs(magnitude - below) < distance)
    up = ops.logical_and(
        step == count - 1, ops.abs(magnitude - above) < distance
    )
    offset = count + step - (0.0 if signed else 1.0)
    offset = offset - ops.cast(down, offset.dtype) + ops.cast(up, offset.dtype)
    if signed:
        negative = normalized < 0
        code = ops.where(
            negative, ops.maximum(127.0 - offset, 0.0), 127.0 + offset
        )
    else:
        code = offset
    return ops.cast(code, "int32")


# For a look-up of the nearest code (torch's, `kmp.core.torch.
# low_precision.nearest_code`): the bits of a float32 below those its key
# keeps. 8 of its mantissa's remain, so a key's values lie within 2**-8 of
# each other, less than the code's smallest relative spacing (0.7%, near
# 1): the nearest code changes at most once in a key's range.
DROPPED_BITS = 15
_KEYS = 2 ** (31 - DROPPED_BITS)


@functools.lru_cache(maxsize=None)
def code_tables(signed: bool):
    """`(candidates, splits)`: for each key (the top bits of a
    non-negative float32), the code nearest to the key's smallest value,
    and the midpoint above which the next code is nearer (inf where that
    is past the key's range)."""
    table = dynamic_code(signed).astype(np.float64)
    midpoints = (table[1:] + table[:-1]) / 2
    keys = np.arange(_KEYS, dtype=np.int64)
    with np.errstate(invalid="ignore"):  # Keys of inf and NaN: above 1.
        low = (keys << DROPPED_BITS).astype(np.uint32).view(np.float32)
        high = ((keys + 1) << DROPPED_BITS).astype(np.uint32)
        high = high.view(np.float32).astype(np.float64)
        low = np.nan_to_num(low.astype(np.float64), nan=1.0)
        low, high = np.minimum(low, 1.0), np.nan_to_num(high, nan=2.0)
    candidate = np.searchsorted(midpoints, low, side="left")
    split = np.full(_KEYS, np.inf)
    inside = candidate < len(midpoints)
    following = midpoints[np.minimum(candidate, len(midpoints) - 1)]
    inside &= following < np.minimum(high, 1.0)
    split[inside] = following[inside]
    return candidate.astype(np.int32), split.astype(np.float32)


def dequantize(codes, scales, signed: bool, shape, block_size: int):
    """The float32 tensor of `shape` that `codes` and `scales` hold."""
    table = ops.convert_to_tensor(dynamic_code(signed))
    values = ops.take(table, ops.cast(codes, "int32"))
    count = scales.shape[0]
    grid = ops.reshape(values, (count, block_size)) * ops.reshape(
        ops.cast(scales, "float32"), (count, 1)
    )
    size = int(np.prod(shape)) if shape else 1
    flat = ops.reshape(grid, (-1,))
    if flat.shape[0] != size:
        flat = flat[:size]
    return ops.reshape(flat, shape)


def encode(value, name: str):
    """What is quantized for slot `name`: the root of a non-negative one."""
    if name in NON_NEGATIVE_SLOTS:
        return ops.sqrt(ops.maximum(value, 0.0))
    return value


def decode(value, name: str):
    """The slot's value from what was quantized (see `encode`)."""
    if name in NON_NEGATIVE_SLOTS:
        return ops.square(value)
    return value


def is_signed(name: str) -> bool:
    """Whether slot `name` is kept on the signed code."""
    return name not in NON_NEGATIVE_SLOTS


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedSlot:
    """One 8-bit slot: its codes and scales (variables of the optimizer
    that owns the slot), the slot's name, shape and block size."""

    codes: object
    scales: object
    name: str
    shape: tuple
    block_size: int

    def read(self):
        """The slot's float32 value now (inside a stateless scope, the
        scope's values)."""
        return self.decoded(self.codes.value, self.scales.value, self.shape)

    def decoded(self, codes, scales, shape):
        """The float32 value of `shape` that `codes` and `scales` (this
        slot's, or a whole number of its blocks) hold."""
        value = dequantize(
            codes, scales, is_signed(self.name), shape, self.block_size
        )
        return decode(value, self.name)

    def encoded(self, value, nearest=None):
        """`(codes, scales)` holding float32 `value` (`nearest`: as for
        `quantize`)."""
        return quantize(
            encode(value, self.name),
            is_signed(self.name),
            self.block_size,
            nearest,
        )


__all__ = [
    "BLOCK_SIZE",
    "DROPPED_BITS",
    "code_tables",
    "nearest_code",
    "QuantizedSlot",
    "CODE_DTYPE",
    "MIN_8BIT_SIZE",
    "blocks",
    "decode",
    "dequantize",
    "dynamic_code",
    "encode",
    "is_signed",
    "quantize",
    "zero_code",
]
