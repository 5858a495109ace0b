"""Float32 arithmetic on low-precision variables, and rounding it back.

`stochastic_round` rounds float32 to bfloat16 or float16 without bias, from
a counter-based random stream keyed by a two-word seed: the same seed gives
the same rounding on every device and in every run. `Float32View` stands in
for a bfloat16 (or float16) variable inside an optimizer's `update_step`: it
reads as the variable plus its compensation in float32 and records what is
assigned. `kmp.core.low_precision.LowPrecisionOptimizer` uses both.

The arithmetic is written once, in `keras.ops`. What differs per backend is
the random stream and how a seed is stored (`kmp.core.tensorflow.rounding`:
TensorFlow's stateless Philox; `kmp.core.jax.rounding` and
`kmp.core.torch.rounding`: the same counter-based hash, its seed two uint32
words on JAX, which has no int64 without x64;
`kmp.core.low_precision.streams()` is this backend's), and on
TensorFlow the view itself, whose optimizers assign to the `tf.Variable`
inside a Keras variable.
"""

import keras
import numpy as np
from keras import ops

LOW_PRECISION_BITS = {
    "bfloat16": 16,
    "float16": 13,
}  # float32 significand bits dropped.
NOISE_BITS = 16  # Random bits per element, enough for both.


def dtype_name(dtype) -> str:
    """`"bfloat16"` for any spelling of a dtype (`tf.bfloat16` too)."""
    return keras.backend.standardize_dtype(dtype)


def is_low(dtype) -> bool:
    """Whether `dtype` is bfloat16 or float16 (None and the quantized
    slots' names, `"8bit"`, `"4bit"` and `"float8"`, are not)."""
    if dtype is None or dtype in ("8bit", "4bit", "float8"):
        return False
    return dtype_name(dtype) in LOW_PRECISION_BITS


def round_with_noise(value, dtype, noise):
    """Rounds float32 `value` to `dtype`, adding `noise` below its last bit.

    `noise` holds `NOISE_BITS` uniform random bits per element (an int32
    tensor shaped like `value`, in [0, 2**16)). Its top bits are added to
    the bits `dtype` drops, then those are cleared: a value rounds away
    from zero with probability equal to its distance from the neighbour
    towards zero, in units of the gap between them, so the result is
    unbiased. Infinities, NaN and representable values stay as they are.
    The bits are added as int32, which wraps like the uint32 they are.
    """
    drop = LOW_PRECISION_BITS[dtype_name(dtype)]
    bits = ops.view(ops.cast(value, "float32"), "int32")
    noise = ops.right_shift(noise, NOISE_BITS - drop)
    mask = -(1 << drop)  # ~(2**drop - 1) as an int32.
    bits = ops.bitwise_and(ops.add(bits, noise), mask)
    return ops.cast(ops.view(bits, "float32"), dtype)


def stochastic_round(value, dtype, seed, streams, part=None):
    """Rounds float32 `value` to `dtype` (bfloat16 or float16), stochastically.

    A value rounds away from zero with probability equal to its distance
    from the neighbour towards zero, in units of the gap between them, so
    the result is unbiased. `seed` is two integers (a shape-[2] tensor or a
    list); the same seed gives the same rounding everywhere (a stateless,
    counter-based stream: `streams`, the backend's module of streams,
    `kmp.core.low_precision.streams()`). `part`: for a part of a variable
    (`kmp.core.low_bit.parts`), the index of its first element in the variable.
    For float16, values in its subnormal range round to nearest.

    >>> from kmp.core.low_precision import streams
    >>> x = keras.ops.full([4000], 1.0 + 2.0**-9)  # A quarter between.
    >>> r = stochastic_round(x, "bfloat16", [1, 2], streams())
    >>> r = keras.ops.convert_to_numpy(keras.ops.cast(r, "float32"))
    >>> sorted(set(r.tolist()))
    [1.0, 1.0078125]
    >>> round(float(r.mean()), 3)
    1.002
    """
    noise = streams.random_bits(seed, value, part)
    return round_with_noise(value, dtype, noise)


def seed_of_saved(value) -> int:
    """The seed a saved seed variable holds, whichever backend saved it:
    one int64 (TensorFlow, torch) or two uint32 words (JAX).

    >>> seed_of_saved(np.int64(2**40 + 3)), seed_of_saved([256, 3])
    (1099511627779, 1099511627779)
    """
    value = np.asarray(value)
    if value.shape == ():
        return int(value)
    high, low = value.astype("int64").astype("uint32").astype("uint64")
    return (int(high) << 32) | int(low)


class Float32View(keras.Variable):
    """A variable's float32 stand-in for one call of an `update_step`.

    On JAX and torch (TensorFlow has
    `kmp.core.tensorflow.rounding.Float32View`).
    A Keras variable to the optimizer, whose operations read `.value`, but
    without storage of its own: it reads as `variable` plus `compensation`
    in `dtype`, computed once, and assignments replace that value and touch
    no variable. The optimizer finds the variable's slots through
    `variable` (`LowPrecisionOptimizer` lends it a `_var_key` that does).
    """

    def __init__(self, variable, compensation, dtype, shape=None):
        # Not Variable.__init__: nothing is allocated, tracked or traced.
        self.variable = variable
        self._compensation = compensation
        self._dtype = dtype
        self._shape = tuple(variable.shape if shape is None else shape)
        self._name = variable.name
        self._path = variable.path
        self._autocast = False
        self._trainable = variable.trainable and shape is None
        self._constraint = None
        self._regularizer = None
        self._overwrite_with_gradient = False
        self._now = None
        self._written = False

    @property
    def value(self):
        if self._now is None:
            value = ops.cast(self.variable.value, self._dtype)
            if self._compensation is not None:
                compensation = self._compensation.value
                value = ops.add(value, ops.cast(compensation, self._dtype))
            self._now = value
            self._read_version = _version(value)
        return self._now

    @property
    def written(self) -> bool:
        """Whether the update assigned to it (or, on torch, wrote in place)."""
        if self._written:
            return True
        return self._now is not None and (
            _version(self._now) != self._read_version
        )

    def assign(self, value):
        self._now = ops.cast(value, self._dtype)
        self._written = True
        return self._now

    def assign_add(self, value):
        return self.assign(ops.add(self.value, value))

    def assign_sub(self, value):
        return self.assign(ops.subtract(self.value, value))

    def numpy(self):
        return ops.convert_to_numpy(self.value)

    def __repr__(self):
        return f"<Float32View of {self._path}, dtype={self._dtype}>"


class DequantizedView(Float32View):
    """A quantized slot's float32 stand-in for one call of an `update_step`
    (JAX, torch; `kmp.core.low_bit.quantization.QuantizedSlot`): reads as the
    slot's dequantized value, computed once; assignments replace that value and
    touch no variable (the caller quantizes what was written)."""

    def __init__(self, slot):
        # Named after the codes, shaped as the slot; nothing allocated.
        super().__init__(slot.codes, None, "float32", shape=slot.shape)
        self.slot = slot

    @property
    def value(self):
        if self._now is None:
            self._now = self.slot.read()
            self._read_version = _version(self._now)
        return self._now

    def __repr__(self):
        return f"<DequantizedView of {self._path}>"


class PartView(Float32View):
    """A part of a variable's update (`kmp.core.low_bit.parts.Part`) as a flat
    float32 stand-in: `Float32View` of its elements."""

    def __init__(self, variable, compensation, dtype, part):
        super().__init__(variable, compensation, dtype, shape=(part.length,))
        self.part = part

    @property
    def value(self):
        if self._now is None:
            value = ops.cast(self.part.of(self.variable), self._dtype)
            if self._compensation is not None:
                compensation = self.part.of(self._compensation)
                value = ops.add(value, ops.cast(compensation, self._dtype))
            self._now = value
            self._read_version = _version(value)
        return self._now


class DequantizedPartView(Float32View):
    """A part of a quantized slot (`kmp.core.low_bit.parts.Part`) as a flat
    float32 stand-in (`DequantizedView` of its elements)."""

    def __init__(self, slot, part):
        super().__init__(slot.codes, None, "float32", shape=(part.length,))
        self.slot = slot
        self.part = part

    @property
    def value(self):
        if self._now is None:
            self._now = self.part.slot_value(self.slot)
            self._read_version = _version(self._now)
        return self._now


class PlainPartView(Float32View):
    """A part of a plain (not quantized) slot (`kmp.core.low_bit.parts.Part`) as
    a flat stand-in in the slot's own dtype: assignments round to it, as
    assigning to the slot whole does."""

    def __init__(self, slot, part):
        super().__init__(slot, None, dtype_name(slot.dtype), (part.length,))
        self.part = part

    @property
    def value(self):
        if self._now is None:
            self._now = ops.cast(self.part.of(self.variable), self._dtype)
            self._read_version = _version(self._now)
        return self._now


def _version(tensor):
    """torch's count of in-place writes to `tensor`; None elsewhere."""
    return getattr(tensor, "_version", None)


__all__ = [
    "DequantizedPartView",
    "DequantizedView",
    "Float32View",
    "LOW_PRECISION_BITS",
    "PartView",
    "PlainPartView",
    "dtype_name",
    "is_low",
    "round_with_noise",
    "seed_of_saved",
    "stochastic_round",
]
