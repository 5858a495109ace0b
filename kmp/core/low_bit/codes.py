"""The codes of quantized optimizer state: what each code stands for.

A quantized slot (`kmp.core.low_bit.quantization`) keeps, for each element, a
code: an index into a table of values in [-1, 1] (signed) or [0, 1]
(unsigned), read as `table[code] * scale` with its block's scale. A
`Code` is such a table, its bits per element and how a value finds the
code nearest to it, elementwise in `keras.ops` (computed, not searched
for: it fuses with the update under XLA). Three, by `slot_dtype`:

* `"8bit"`: the *dynamic code* (bitsandbytes', after Dettmers et al.,
  "8-bit Optimizers via Block-wise Quantization", ICLR 2022): 256
  values, like a float's, each decade below 1 its own run of them, the
  top decade half, the next a quarter, down to 1e-6; relative precision
  over seven decades, where a linear int8 code keeps two. Blocks of 256.
* `"4bit"`: 16 values, 0 and values evenly spaced in log10 below 1:
  7 a side over 2 decades (signed), 15 over 4 (unsigned, the second
  moment's root); two codes per byte, blocks of 128 (torchao's
  `AdamW4bit` block size).
* `"float8"`: the code is the float8_e4m3fn number itself (its byte;
  `table` gives each byte's value divided by 448, the format's largest),
  rounded to nearest-even as a cast to float8 rounds; blocks of 256
  (torchao's `AdamWFp8`). Its 3 mantissa bits keep 6% relative
  precision over 2**-9 to 448, 17 octaves.

`benchmarks/diagnostics/low_bit_look.py` measured, before they were built,
that the 4-bit and float8 codes train the benchmarks' models as well as 8
bits.
"""

import dataclasses
import functools
from typing import Callable

import numpy as np
from keras import ops

DECADES = 7  # The dynamic code's: 1 down to 1e-6.


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


def nearest_dynamic(normalized, signed: bool):
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


@functools.lru_cache(maxsize=None)
def lookup_table(signed: bool) -> np.ndarray:
    """`code_tables(signed)` for the keys of values in [0, 1] (those
    `nearest_lookup` reads) as one int32 per key: the candidate code
    times 2**16, plus the low `DROPPED_BITS` bits of the split's float32
    (a split lies in its key's range, so its other bits are the key's;
    2**15, past any value's low bits, where the key has no split). 32,513
    keys, 130 KB: one look-up per value, in a table a CPU's cache keeps.
    """
    candidates, splits = code_tables(signed)
    keys = (int(np.float32(1.0).view(np.int32)) >> DROPPED_BITS) + 1
    candidates, splits = candidates[:keys], splits[:keys]
    low = 2**DROPPED_BITS
    with np.errstate(invalid="ignore"):
        bits = splits.view(np.int32).astype(np.int64)
    same_key = (bits >> DROPPED_BITS) == np.arange(keys)
    inside = np.isfinite(splits) & same_key
    # A split rounded up onto the next key's first value: past every value
    # of this key, as no split.
    low_bits = np.where(inside, bits & (low - 1), low)
    return (candidates.astype(np.int64) * 2**16 + low_bits).astype(np.int32)


def nearest_lookup(normalized, signed: bool, look_up=None):
    """The 8-bit dynamic code (int32 in [0, 255]) nearest to each value in
    [-1, 1], looked up by the float's top bits: the key's candidate
    (`code_tables`), plus one where the value is past the key's split,
    compared on the bits below the key (`lookup_table`: for non-negative
    floats the order of their bits is the order of their values); a
    negative value's code mirrors its magnitude's (254 - code: the signed
    code is symmetric about 0's, 127, and -1 is not one).

    About ten operations and one look-up per element where
    `nearest_dynamic` takes some eighty; the same code as it, or on a
    midpoint between two codes (where the two differ by a float32
    rounding) the other one, as near. torch's form looks up the same
    candidates and splits (`kmp.core.torch.codes.nearest_dynamic`).

    `look_up(table, keys)` reads the table (default `ops.take`): JAX's
    backend gives its own form (`kmp.core.jax.low_precision`).
    """
    table = ops.convert_to_tensor(lookup_table(signed))
    magnitude = ops.minimum(ops.abs(normalized), 1.0)
    bits = ops.view(magnitude, "int32")
    look_up = look_up or ops.take
    entry = look_up(table, ops.right_shift(bits, DROPPED_BITS))
    low = ops.bitwise_and(bits, 2**DROPPED_BITS - 1)
    split = ops.bitwise_and(entry, 2**16 - 1)
    code = ops.right_shift(entry, 16) + ops.cast(low > split, "int32")
    if signed:
        mirrored = ops.maximum(254 - code, 0)
        code = ops.where(normalized < 0, mirrored, code)
    return code


@functools.lru_cache(maxsize=None)
def log_code(signed: bool) -> np.ndarray:
    """The 4-bit code's values, sorted, float32: 0 and, on each side of
    it (signed) or above it, values evenly spaced in log10 from 10**-2
    (7 of them, signed) or 10**-4 (15, unsigned) to 1.

    >>> [round(float(v), 4) for v in log_code(signed=True)[7:]]
    [0.0, 0.01, 0.0215, 0.0464, 0.1, 0.2154, 0.4642, 1.0]
    >>> len(log_code(signed=False)), round(float(log_code(False)[1]), 6)
    (16, 0.0001)
    """
    count, decades = (7, 2) if signed else (15, 4)
    side = 10.0 ** np.linspace(-decades, 0, count)
    parts = [[0.0], side] + ([-side] if signed else [])
    return np.sort(np.concatenate(parts)).astype(np.float32)


def nearest_in_table(normalized, table):
    """The index of the value of sorted `table` nearest to each element
    (int32): how many midpoints between neighbours lie below it, by a
    binary search without branches (for short tables).

    The midpoints, padded with infinities to `2**levels - 1`, are
    searched from the middle: at each level one comparison with the
    midpoint the answers so far lead to, picked among constants by those
    answers (`where`), and the answer is the index's next bit. For the
    4-bit code's 15 midpoints: 4 comparisons and 11 selections per
    element where counting them takes 15 comparisons, 15 conversions and
    14 additions.
    """
    table = np.asarray(table, np.float64)
    midpoints = ((table[1:] + table[:-1]) / 2).astype(np.float32)
    levels = max(1, int(np.ceil(np.log2(len(midpoints) + 1))))
    padding = 2**levels - 1 - len(midpoints)
    midpoints = np.concatenate([midpoints, np.full(padding, np.inf)])
    midpoints = midpoints.astype(np.float32)
    answers = []  # One boolean per level so far, the first the highest bit.

    def threshold(depth, first, step):
        # The midpoint `step` past `first`, where the search's remaining
        # range starts given the answers from `depth` on.
        if depth == len(answers):
            return float(midpoints[first + step - 1])
        size = 2 ** (levels - 1 - depth)
        return ops.where(
            answers[depth],
            threshold(depth + 1, first + size, step),
            threshold(depth + 1, first, step),
        )

    code = None
    for level in range(levels):
        step = 2 ** (levels - 1 - level)
        above = normalized > threshold(0, 0, step)
        bit = ops.where(above, step, 0)
        code = bit if code is None else code + bit
        answers.append(above)
    return ops.cast(code, "int32")


def nearest_log(normalized, signed: bool):
    """The 4-bit code (an int32 in [0, 15]) nearest to each value."""
    return nearest_in_table(normalized, log_code(signed))


FLOAT8_MAX = 448.0  # float8_e4m3fn's largest finite value.


@functools.lru_cache(maxsize=None)
def float8_code(signed: bool = True) -> np.ndarray:
    """The value of each float8_e4m3fn byte (1 sign, 4 exponent with a
    bias of 7, 3 mantissa bits; no infinities, 0x7F and 0xFF are NaN),
    divided by 448, float32 (the format is signed either way).

    >>> code = float8_code()
    >>> float(code[0x7E]), float(code[0x01] * 448), float(code[0xB8] * 448)
    (1.0, 0.001953125, -1.0)
    """
    del signed
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 15, bits & 7
    magnitude = np.where(
        exponent == 0,
        mantissa * 2.0**-9,
        (1 + mantissa / 8) * 2.0 ** (exponent - 7.0),
    )
    value = np.where(bits >= 128, -magnitude, magnitude)
    value[(exponent == 15) & (mantissa == 7)] = np.nan
    return (value / FLOAT8_MAX).astype(np.float32)


def nearest_float8(normalized, signed: bool = True):
    """The float8_e4m3fn byte (an int32 in [0, 255]) of each value in
    [-1, 1] times 448, rounded to nearest-even as a cast rounds, from the
    float32's bits: about a dozen integer operations.

    A normal float8 (2**-6 up to 448) keeps 3 of float32's 23 mantissa
    bits: adding `2**19 - 1` and the lowest kept bit to the float32's
    bits rounds the dropped 20 to nearest-even (a carry into the exponent
    is the next power of two's byte), and the bits above them, less the
    exponent bias's difference (127 - 7) times 8, are the byte. A
    subnormal (below 2**-6) is `round(y * 2**9)` (exact, half to even),
    which is its byte. A negative value's byte has the sign bit (128);
    one that rounds to 0 keeps it, as the cast's -0.0 does (0.0 and -0.0
    themselves are written as +0.0's byte).
    """
    del signed
    y = ops.minimum(ops.abs(normalized), 1.0) * FLOAT8_MAX
    bits = ops.view(y, "int32")
    kept = ops.bitwise_and(ops.right_shift(bits, 20), 1)
    normal = ops.right_shift(bits + (2**19 - 1) + kept, 20) - (127 - 7) * 8
    subnormal = ops.cast(ops.round(y * 2.0**9), "int32")
    byte = ops.where(y < 2.0**-6, subnormal, normal)
    negative = ops.logical_and(normalized < 0, y > 0)
    return ops.where(negative, byte + 128, byte)


@dataclasses.dataclass(frozen=True)
class Code:
    """A code of quantized state: `bits` per element (4: two codes per
    byte, the first in the high half), the default elements per block,
    the values the codes stand for (`table(signed)`, indexed by code) and
    how a value in [-1, 1] finds its code (`nearest(normalized, signed)`,
    an int32 tensor)."""

    name: str
    bits: int
    block_size: int
    values: Callable = dataclasses.field(repr=False)
    find: Callable = dataclasses.field(repr=False)

    def table(self, signed: bool) -> np.ndarray:
        return self.values(signed)

    def nearest(self, normalized, signed: bool):
        return self.find(normalized, signed)

    def zero(self, signed: bool) -> int:
        """The code of 0 (what a new slot's codes are filled with)."""
        return int(np.flatnonzero(self.table(signed) == 0.0)[0])

    @property
    def per_byte(self) -> int:
        """Codes per byte."""
        return 8 // self.bits


CODES = {
    code.name: code
    for code in (
        Code("8bit", 8, 256, dynamic_code, nearest_lookup),
        Code("4bit", 4, 128, log_code, nearest_log),
        Code("float8", 8, 256, float8_code, nearest_float8),
    )
}


def nearest(normalized, signed: bool, code: Code):
    """`code.nearest`: the form of the backends whose compiler fuses it
    (JAX, TensorFlow); torch's is `kmp.core.torch.low_precision`'s."""
    return code.nearest(normalized, signed)


__all__ = [
    "CODES",
    "Code",
    "DROPPED_BITS",
    "FLOAT8_MAX",
    "code_tables",
    "dynamic_code",
    "float8_code",
    "log_code",
    "lookup_table",
    "nearest",
    "nearest_dynamic",
    "nearest_float8",
    "nearest_in_table",
    "nearest_log",
    "nearest_lookup",
]
