"""Quantized optimizer state: block-wise codes with a scale per block.

An optimizer slot (Adam's moments, momentum) of `n` elements is kept as
`n` codes (one byte each, or two to a byte for 4 bits) and one float32
scale per block of `block_size` elements, as in bitsandbytes' 8-bit
optimizers (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", ICLR 2022):

* a block's scale is its largest absolute value, so every block uses the
  whole code, and one outlier costs only its own block precision;
* a value divided by its block's scale is written as the code nearest to
  it, and read as `table[code] * scale` (the codes, their tables and how
  a value finds its code are `kmp.core.codes`').

Slots whose values cannot be negative (Adam's second moment) are kept as
their square root (on the unsigned code where the code has one): the
second moment spans twice the decades of the gradients it averages, and
a value that fell to 0 while the first moment did not would divide by
epsilon alone. On the root, a second moment reads as 0 only where the
first moment does too.

Everything is `keras.ops`: the same arithmetic on every backend, inside
`jit`, `tf.function` and XLA. `kmp.core.low_precision` keeps the codes
and scales as the inner optimizer's variables and hands its update a
float32 view of them (`kmp.core.rounding.DequantizedView`,
`kmp.core.tensorflow.rounding.DequantizedView`).
"""

import dataclasses
import math

import numpy as np
from keras import ops

from kmp.core import codes as codes_module

BLOCK_SIZE = 256  # The 8-bit code's elements per scale (torchao's).
MIN_8BIT_SIZE = 4096  # Smaller variables keep their slots (bitsandbytes').
CODE_DTYPE = "uint8"

# Slot names (Keras's `add_variable_from_reference` names) whose values
# are never negative: kept as the root on the unsigned code.
NON_NEGATIVE_SLOTS = ("velocity", "velocity_hat")


def blocks(size: int, block_size: int) -> int:
    """The number of blocks of `size` elements."""
    return max(1, math.ceil(size / block_size))


def pack(codes, code):
    """`codes` (int32, flat, an even count for 4 bits) as bytes: two to a
    byte for 4 bits, the first in the high half."""
    if code.bits == 4:
        pairs = ops.reshape(codes, (-1, 2))
        codes = pairs[:, 0] * 16 + pairs[:, 1]
    return ops.cast(codes, CODE_DTYPE)


def unpack(data, code):
    """The int32 codes that bytes `data` hold (`pack`'s inverse)."""
    data = ops.cast(data, "int32")
    if code.bits == 4:
        pairs = ops.stack([data // 16, data % 16], axis=1)
        data = ops.reshape(pairs, (-1,))
    return data


def quantize(value, code, signed: bool, block_size: int, nearest=None):
    """`(codes, scales)` of a float32 tensor: the codes packed in `uint8`
    bytes (`pack`), flat and padded to whole blocks, and one float32 scale
    per block (the block's largest absolute value; 0 for a block of
    zeros).

    A value divided by its block's scale is written as the nearest code:
    `nearest(normalized, signed, code)`, `kmp.core.codes.nearest` by
    default (each backend's package picks its fastest form).
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
    nearest = nearest or codes_module.nearest
    return pack(nearest(normalized, signed, code), code), scales


def dequantize(data, scales, code, signed: bool, shape, block_size: int):
    """The float32 tensor of `shape` that bytes `data` and `scales` hold."""
    table = ops.convert_to_tensor(code.table(signed))
    values = ops.take(table, unpack(data, code))
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


def byte_count(elements, code):
    """The bytes of `elements` codes (a whole number of bytes; `elements`
    may be a traced integer)."""
    return elements // code.per_byte if code.per_byte > 1 else elements


def zero_byte(code, signed: bool) -> int:
    """The byte a new slot's codes are filled with (every code 0.0's)."""
    zero = code.zero(signed)
    return zero * 16 + zero if code.bits == 4 else zero


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedSlot:
    """One quantized slot: its codes and scales (variables of the
    optimizer that owns the slot), the slot's name, shape, block size and
    code (`kmp.core.codes.Code`)."""

    codes: object
    scales: object
    name: str
    shape: tuple
    block_size: int
    code: codes_module.Code

    def read(self):
        """The slot's float32 value now (inside a stateless scope, the
        scope's values)."""
        return self.decoded(self.codes.value, self.scales.value, self.shape)

    def decoded(self, data, scales, shape):
        """The float32 value of `shape` that bytes `data` and `scales`
        (this slot's, or a whole number of its blocks) hold."""
        value = dequantize(
            data,
            scales,
            self.code,
            is_signed(self.name),
            shape,
            self.block_size,
        )
        return decode(value, self.name)

    def encoded(self, value, nearest=None):
        """`(codes, scales)` holding float32 `value` (`nearest`: as for
        `quantize`)."""
        return quantize(
            encode(value, self.name),
            self.code,
            is_signed(self.name),
            self.block_size,
            nearest,
        )


__all__ = [
    "BLOCK_SIZE",
    "CODE_DTYPE",
    "MIN_8BIT_SIZE",
    "QuantizedSlot",
    "blocks",
    "byte_count",
    "decode",
    "dequantize",
    "encode",
    "is_signed",
    "pack",
    "quantize",
    "unpack",
    "zero_byte",
]
