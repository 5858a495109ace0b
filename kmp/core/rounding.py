"""Float32 arithmetic on low-precision variables, and rounding it back.

`Float32View` stands in for a bfloat16 (or float16) variable inside an
optimizer's `update_step`: it reads as the variable plus its compensation in
float32 and records what is assigned. `stochastic_round` rounds float32 to
bfloat16 or float16 without bias, from a stateless random stream.
`kmp.core.low_precision.LowPrecisionOptimizer` uses both.
"""

import keras
import tensorflow as tf

from kmp.core import backend

backend.tensorflow()  # TensorFlow backend only.

LOW_PRECISION_BITS = {
    "bfloat16": 16,
    "float16": 13,
}  # float32 significand bits dropped.


def stochastic_round(value, dtype, seed):
    """Rounds float32 `value` to `dtype` (bfloat16 or float16), stochastically.

    Uniform random bits are added below the last bit `dtype` keeps, then
    truncated: a value rounds away from zero with probability equal to its
    distance from the neighbour towards zero, in units of the gap between
    them, so the result is unbiased. `seed` is a shape-[2] integer tensor;
    the same seed gives the same rounding everywhere (Philox, stateless).
    For float16, values in its subnormal range round to nearest.

    >>> x = tf.fill([4000], 1.0 + 2.0**-9)  # A quarter between neighbours.
    >>> r = stochastic_round(x, "bfloat16", tf.constant([1, 2]))
    >>> sorted(set(r.numpy().astype(float).tolist()))
    [1.0, 1.0078125]
    >>> round(float(tf.reduce_mean(tf.cast(r, tf.float32))), 3)
    1.002
    """
    drop = LOW_PRECISION_BITS[tf.as_dtype(dtype).name]
    bits = tf.bitcast(tf.cast(value, tf.float32), tf.uint32)
    # 16 random bits are enough: each 32-bit draw serves two elements.
    size = tf.size(bits)
    noise = tf.random.stateless_uniform(
        [(size + 1) // 2], seed, None, None, tf.uint32, alg="philox"
    )
    noise = tf.reshape(tf.bitcast(noise, tf.uint16), [-1])[:size]
    noise = tf.bitwise.right_shift(
        tf.reshape(tf.cast(noise, tf.uint32), tf.shape(bits)),
        tf.constant(16 - drop, tf.uint32),
    )
    mask = tf.constant(~((1 << drop) - 1) & 0xFFFFFFFF, tf.uint32)
    bits = tf.bitwise.bitwise_and(bits + noise, mask)
    return tf.cast(tf.bitcast(bits, tf.float32), dtype)


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
