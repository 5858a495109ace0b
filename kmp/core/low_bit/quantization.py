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
  a value finds its code are `kmp.core.low_bit.codes`').

Slots whose values cannot be negative (Adam's second moment) are kept as
their square root (on the unsigned code where the code has one): the
second moment spans twice the decades of the gradients it averages, and
a value that fell to 0 while the first moment did not would divide by
epsilon alone. On the root, a second moment reads as 0 only where the
first moment does too.

The blocks are `block_size` consecutive elements of the flattened slot
(row-major). Where they tile the variable's rows (its last axis a
multiple of the block, or a divisor of it whose rows group into whole
blocks: `Storage`), the codes are kept in the variable's own shape (4
bits: the last axis halved) and the scales in its shape with the blocked
axis divided, so a layout that shards the variable shards its slots the
same way (`kmp.core.low_bit.slots`); the numbers are those of the flat
blocks. Other shapes keep flat codes padded to whole blocks.

Everything is `keras.ops`: the same arithmetic on every backend, inside
`jit`, `tf.function` and XLA. `kmp.core.low_precision` keeps the codes
and scales as the inner optimizer's variables and hands its update a
float32 view of them (`kmp.core.low_bit.rounding.DequantizedView`,
`kmp.core.tensorflow.rounding.DequantizedView`).
"""

import dataclasses
import math
import sys

import numpy as np
from keras import ops

from kmp.core.low_bit import codes as codes_module

BLOCK_SIZE = 256  # The 8-bit code's elements per scale (torchao's).
MIN_8BIT_SIZE = 4096  # Smaller variables keep their slots (bitsandbytes').
CODE_DTYPE = "uint8"
SCALE_DTYPE = "float32"
_LITTLE_ENDIAN = sys.byteorder == "little"

# Slot names (Keras's `add_variable_from_reference` names) whose values
# are never negative: kept as the root on the unsigned code.
NON_NEGATIVE_SLOTS = ("velocity", "velocity_hat")


def blocks(size: int, block_size: int) -> int:
    """The number of blocks of `size` elements."""
    return max(1, math.ceil(size / block_size))


def pack(codes, code):
    """`codes` (int32 or uint8, an even count on the last axis for 4 bits)
    as bytes: two neighbours on the last axis to a byte for 4 bits, the
    first in the high half.

    The pairs are read as one 16-bit word each (`ops.view` of the codes'
    bytes as int16, which every backend can view and shift; the first of
    two is the word's low byte on a little-endian machine): contiguous
    arithmetic, which XLA vectorizes, where taking every other element
    did not (TensorFlow's 4-bit update took 3.5x float32 AdamW's).
    """
    if code.bits == 4:
        if _LITTLE_ENDIAN:
            pairs = ops.view(ops.cast(codes, CODE_DTYPE), "int16")
            low = ops.bitwise_and(pairs, 0xFF)
            high = ops.bitwise_and(ops.right_shift(pairs, 8), 0xFF)
            codes = ops.bitwise_or(ops.left_shift(low, 4), high)
        else:
            shape = tuple(codes.shape)
            pairs = ops.reshape(codes, (*shape[:-1], shape[-1] // 2, 2))
            codes = pairs[..., 0] * 16 + pairs[..., 1]
    return ops.cast(codes, CODE_DTYPE)


def unpack(data, code):
    """The int32 codes that bytes `data` hold (`pack`'s inverse): for 4
    bits, each byte made a 16-bit word whose bytes are its two codes."""
    if code.bits == 4:
        if _LITTLE_ENDIAN:
            words = ops.cast(data, "int32")
            first = ops.right_shift(words, 4)
            second = ops.left_shift(ops.bitwise_and(words, 15), 8)
            pairs = ops.cast(ops.bitwise_or(first, second), "int16")
            data = ops.view(pairs, CODE_DTYPE)
        else:
            data = ops.cast(data, "int32")
            shape = tuple(data.shape)
            pairs = ops.stack([data // 16, data % 16], axis=-1)
            data = ops.reshape(pairs, (*shape[:-1], shape[-1] * 2))
    return ops.cast(data, "int32")


@dataclasses.dataclass(frozen=True)
class Storage:
    """How a slot of `shape` keeps its flat blocks in its own axes
    (`storage`): `codes` and `scales` are the two variables' shapes; a
    block is `block_size` elements of one row (`rows` == 1: the block
    divides the last axis) or `rows` whole rows (`rows` > 1: the last axis
    divides the block)."""

    shape: tuple
    block_size: int
    rows: int
    codes: tuple
    scales: tuple

    @property
    def grid(self) -> tuple:
        """The value's shape with its blocks as axes of their own."""
        *lead, columns = self.shape
        if self.rows == 1:
            return (*lead, columns // self.block_size, self.block_size)
        *outer, rows = lead
        return (*outer, rows // self.rows, self.rows, columns)

    @property
    def within(self) -> tuple:
        """The axes of `grid` inside one block."""
        return (-1,) if self.rows == 1 else (-2, -1)

    @property
    def per_block(self) -> tuple:
        """The scales' shape broadcast over `grid`."""
        return self.scales + (1,)


def storage(shape, block_size: int, code):
    """The `Storage` of a slot of `shape`: its blocks tile its rows (the
    last axis a multiple of `block_size`, or a divisor of it with whole
    blocks of rows in the next axis, and whole bytes on the last axis); None
    where they do not (flat codes, padded to whole blocks)."""
    shape = tuple(int(d) for d in shape)
    if not shape or math.prod(shape) == 0:
        return None
    columns = shape[-1]
    if columns % code.per_byte:
        return None
    codes = (*shape[:-1], columns // code.per_byte)
    if columns % block_size == 0:
        scales = (*shape[:-1], columns // block_size)
        return Storage(shape, block_size, 1, codes, scales)
    rows = block_size // columns
    if len(shape) < 2 or block_size % columns or shape[-2] % rows:
        return None
    scales = (*shape[:-2], shape[-2] // rows, 1)
    return Storage(shape, block_size, rows, codes, scales)


def quantize_shaped(value, code, signed: bool, layout: Storage, nearest=None):
    """`quantize` of a whole slot kept in `layout` (`Storage`): the codes
    in the slot's own shape (4 bits: its last axis halved), the scales in
    `layout.scales`; the same blocks, scales and codes as `quantize`'s,
    reshaped."""
    grid = ops.reshape(ops.cast(value, "float32"), layout.grid)
    scales = ops.max(ops.abs(grid), axis=layout.within)
    divisor = ops.where(scales > 0, scales, ops.ones_like(scales))
    normalized = grid / ops.reshape(divisor, layout.per_block)
    normalized = ops.reshape(normalized, layout.shape)
    nearest = nearest or codes_module.nearest
    codes = pack(nearest(normalized, signed, code), code)
    return codes, ops.reshape(scales, layout.scales)


def dequantize_shaped(data, scales, code, signed: bool, layout: Storage):
    """The float32 slot that `quantize_shaped`'s codes and scales hold."""
    table = ops.convert_to_tensor(code.table(signed))
    values = ops.reshape(ops.take(table, unpack(data, code)), layout.grid)
    scales = ops.reshape(ops.cast(scales, "float32"), layout.per_block)
    return ops.reshape(values * scales, layout.shape)


def quantize(value, code, signed: bool, block_size: int, nearest=None):
    """`(codes, scales)` of a float32 tensor: the codes packed in `uint8`
    bytes (`pack`), flat and padded to whole blocks, and one float32 scale
    per block (the block's largest absolute value; 0 for a block of
    zeros).

    A value divided by its block's scale is written as the nearest code:
    `nearest(normalized, signed, code)`, `kmp.core.low_bit.codes.nearest` by
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


def bytes_per_element(code, block_size=None) -> float:
    """The bytes a quantized slot keeps per element: its code (a byte, or
    half of one for 4 bits) and its share of its block's scale
    (`block_size`, default the code's). Where the blocks tile the slot.

    >>> bytes_per_element(codes_module.CODES["8bit"])
    1.015625
    """
    block_size = block_size or code.block_size
    scale = np.dtype(SCALE_DTYPE).itemsize
    return 1 / code.per_byte + scale / block_size


def zero_byte(code, signed: bool) -> int:
    """The byte a new slot's codes are filled with (every code 0.0's)."""
    zero = code.zero(signed)
    return zero * 16 + zero if code.bits == 4 else zero


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedSlot:
    """One quantized slot: its codes and scales (variables of the
    optimizer that owns the slot), the slot's name, shape, block size and
    code (`kmp.core.low_bit.codes.Code`), and how the codes and scales lie
    (`Storage`; None: flat)."""

    codes: object
    scales: object
    name: str
    shape: tuple
    block_size: int
    code: codes_module.Code
    storage: object = None

    def read(self):
        """The slot's float32 value now (inside a stateless scope, the
        scope's values)."""
        data, scales = self.codes.value, self.scales.value
        if self.storage is None:
            return self.decoded(data, scales, self.shape)
        signed = is_signed(self.name)
        value = dequantize_shaped(data, scales, self.code, signed, self.storage)
        return decode(value, self.name)

    def decoded(self, data, scales, shape):
        """The float32 value of `shape` that flat bytes `data` and `scales`
        (this slot's flattened, or a whole number of its blocks) hold."""
        value = dequantize(
            ops.reshape(data, (-1,)),
            ops.reshape(scales, (-1,)),
            self.code,
            is_signed(self.name),
            shape,
            self.block_size,
        )
        return decode(value, self.name)

    def encoded(self, value, nearest=None):
        """`(codes, scales)` holding the slot's whole float32 `value`, as
        the slot's variables are shaped (`nearest`: as for `quantize`)."""
        if self.storage is None:
            return self.encoded_flat(value, nearest)
        return quantize_shaped(
            encode(value, self.name),
            self.code,
            is_signed(self.name),
            self.storage,
            nearest,
        )

    def encoded_flat(self, value, nearest=None):
        """`(codes, scales)`, flat, holding float32 `value` (the slot's, or a
        whole number of its blocks: `kmp.core.low_bit.parts`)."""
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
    "SCALE_DTYPE",
    "Storage",
    "blocks",
    "byte_count",
    "bytes_per_element",
    "decode",
    "dequantize",
    "dequantize_shaped",
    "encode",
    "is_signed",
    "pack",
    "quantize",
    "quantize_shaped",
    "storage",
    "unpack",
    "zero_byte",
]
