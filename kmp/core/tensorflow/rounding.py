"""Stochastic rounding's random stream and the float32 view, on TensorFlow.

The stream is TensorFlow's stateless Philox: a variable's key at a step is
`stateless_fold_in([seed, step], index)`, and each 32-bit draw gives two
elements their 16 bits. The seed is one int64 variable. `Float32View` is
a plain object, not a Keras variable: TensorFlow's optimizers assign to
the `tf.Variable` inside a Keras variable, and call the view's `assign`
methods directly when it is none.
"""

import keras
import numpy as np

from kmp.core import backend

tf = backend.tensorflow()

SEED_SHAPE = ()
SEED_DTYPE = "int64"


def seed_value(seed: int):
    """What the optimizer's seed variable holds for `seed`."""
    return np.int64(seed)


def seed_of(value) -> int:
    """The seed a seed variable's value (`seed_value`'s result) holds."""
    return int(np.asarray(value))


def step_seed(seed, step, index: int):
    """The stream's key for variable `index` at `step` (a shape-[2] int64)."""
    seed = tf.stack(
        [
            tf.convert_to_tensor(seed),
            tf.cast(tf.convert_to_tensor(step), tf.int64),
        ]
    )
    return tf.random.experimental.stateless_fold_in(seed, index, alg="philox")


def random_bits(seed, like, part=None):
    """16 uniform random bits per element of `like`, as int32 (Philox);
    for a part of a variable (`part`: its first element's index, maybe a
    tensor), from the seed with `part` folded in."""
    if part is not None:
        seed = tf.random.experimental.stateless_fold_in(
            tf.convert_to_tensor(seed), tf.cast(part, tf.int64), alg="philox"
        )
    size = tf.size(like)
    # 16 random bits are enough: each 32-bit draw serves two elements.
    noise = tf.random.stateless_uniform(
        [(size + 1) // 2],
        tf.convert_to_tensor(seed),
        None,
        None,
        tf.uint32,
        alg="philox",
    )
    noise = tf.reshape(tf.bitcast(noise, tf.uint16), [-1])[:size]
    return tf.reshape(tf.cast(noise, tf.int32), tf.shape(like))


class Float32View:
    """A variable's float32 stand-in for one call of an `update_step`.

    Reads as the variable (plus its compensation) in float32, computed once;
    assignments replace that value, in float32, and touch no variable.
    `_unique_id` is the variable's slot key (what `Optimizer._var_key` gives).
    """

    __array_ufunc__ = None  # NumPy defers to the reflected operators.

    def __init__(self, variable, model_variable, compensation, key, dtype):
        self._variable = variable
        self._compensation = compensation
        self._unique_id = key
        self.dtype = dtype
        self.shape = model_variable.shape
        self.name = model_variable.name
        self.path = model_variable.path
        self._value = None
        self.written = False

    @property
    def value(self):
        if self._value is None:
            value = tf.cast(tf.convert_to_tensor(self._variable), self.dtype)
            if self._compensation is not None:
                compensation = tf.convert_to_tensor(self._compensation)
                value += tf.cast(compensation, self.dtype)
            self._value = value
        return self._value

    def assign(self, value):
        self._value = tf.cast(value, self.dtype)
        self.written = True

    def assign_add(self, value):
        self.assign(self.value + tf.cast(value, self.dtype))

    def assign_sub(self, value):
        self.assign(self.value - tf.cast(value, self.dtype))

    def scatter_update(self, slices):
        indices = tf.expand_dims(slices.indices, -1)
        self.assign(
            tf.tensor_scatter_nd_update(self.value, indices, slices.values)
        )

    def scatter_add(self, slices):
        indices = tf.expand_dims(slices.indices, -1)
        self.assign(
            tf.tensor_scatter_nd_add(self.value, indices, slices.values)
        )

    def scatter_sub(self, slices):
        indices = tf.expand_dims(slices.indices, -1)
        self.assign(
            tf.tensor_scatter_nd_sub(self.value, indices, slices.values)
        )

    def __tf_tensor__(self, dtype=None, name=None):
        return tf.convert_to_tensor(self.value, dtype=dtype, name=name)

    def __neg__(self):
        return -self.value

    def __getitem__(self, index):
        return self.value[index]


class DequantizedView(Float32View):
    """A quantized slot's float32 stand-in for one call of an `update_step`
    (`kmp.core.low_bit.quantization.QuantizedSlot`): reads as the slot's
    dequantized value, computed once; assignments replace that value."""

    def __init__(self, slot):
        # Not Float32View.__init__: there is no variable of this shape.
        self.slot = slot
        self._variable = None
        self._compensation = None
        self._unique_id = None
        self.dtype = tf.float32
        self.shape = tf.TensorShape(slot.shape)
        self.name = slot.codes.name
        self.path = slot.codes.path
        self._value = None
        self.written = False

    @property
    def value(self):
        if self._value is None:
            self._value = tf.convert_to_tensor(self.slot.read())
        return self._value


class PartView(Float32View):
    """A part of a variable's update (`kmp.core.low_bit.parts.Part`) as a flat
    float32 stand-in: `Float32View` of its elements (`compensation`: the
    compensation variable, read through the part)."""

    def __init__(
        self, variable, model_variable, compensation, key, dtype, part
    ):
        super().__init__(variable, model_variable, None, key, dtype)
        self._part_compensation = compensation
        self.part = part
        self.shape = tf.TensorShape([part.length])

    @property
    def value(self):
        if self._value is None:
            value = tf.cast(self.part.of(self._variable), self.dtype)
            if self._part_compensation is not None:
                compensation = self.part.of(self._part_compensation)
                value += tf.cast(compensation, self.dtype)
            self._value = value
        return self._value


class DequantizedPartView(DequantizedView):
    """A part of a quantized slot (`kmp.core.low_bit.parts.Part`) as a flat
    float32 stand-in."""

    def __init__(self, slot, part):
        super().__init__(slot)
        self.part = part
        self.shape = tf.TensorShape([part.length])

    @property
    def value(self):
        if self._value is None:
            self._value = tf.convert_to_tensor(self.part.slot_value(self.slot))
        return self._value


class PlainPartView(Float32View):
    """A part of a plain (not quantized) slot (`kmp.core.low_bit.parts.Part`) as
    a flat stand-in in the slot's own dtype: assignments round to it, as
    assigning to the slot whole does."""

    def __init__(self, slot, part):
        super().__init__(slot, slot, None, None, slot.dtype)
        self.part = part
        self.shape = tf.TensorShape([part.length])

    @property
    def value(self):
        if self._value is None:
            value = tf.convert_to_tensor(self.part.of(self._variable))
            self._value = tf.cast(value, self.dtype)
        return self._value


def _operator(function, reflected):
    def method(self, other):
        if reflected:
            return function(other, self.value)
        return function(self.value, other)

    return method


for _name, _function in {
    "add": keras.ops.add,
    "sub": keras.ops.subtract,
    "mul": keras.ops.multiply,
    "truediv": keras.ops.divide,
    "pow": keras.ops.power,
    "matmul": keras.ops.matmul,
}.items():
    setattr(Float32View, f"__{_name}__", _operator(_function, False))
    setattr(Float32View, f"__r{_name}__", _operator(_function, True))
