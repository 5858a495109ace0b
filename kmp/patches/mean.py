"""Patch `mean`: means of bfloat16 tensors without a float32 copy.

Keras 3's `keras.ops.mean` on TensorFlow casts a low-precision input to
float32, reduces, and casts the result back, because TensorFlow's float16
mean could overflow. Under `mixed_bfloat16` that float32 copy, and the float32
gradient of the same size in the backward pass, are the largest tensors of
layers such as `GlobalAveragePooling2D` (measured with
`python benchmarks/memory_breakdown.py --models cnn`; numbers in
`benchmarks/results/memory_breakdown.json`).

bfloat16 has float32's range, so its mean cannot overflow, and TensorFlow's
bfloat16 `reduce_mean` adds up in float32 without a float32 copy of the
input. The patch uses it for a dense bfloat16 tensor whose reduced element
count is known and exactly a bfloat16 number (every count up to 256, and
e.g. 1024 = 32 x 32 or 784 = 28 x 28); the forward result is then Keras's.
Its gradient is Keras's too, computed on the small upstream gradient: cast
to float32, divided by the count, rounded to bfloat16 once, then broadcast
in bfloat16 - the same elementwise arithmetic as Keras's float32 gradient
followed by its cast, eagerly, in graphs and under XLA. (TensorFlow's own
bfloat16 gradient, which kmp used before, divides in bfloat16; in a graph
TensorFlow's optimizer turns that into a product by a rounded reciprocal,
which is not Keras's result.) Every other input (float16, float32, integers,
sparse tensors, other counts) goes to Keras's `mean`. TensorFlow backend
only.
"""

import math

from keras.src.backend.tensorflow import numpy as _keras_tf_numpy

from kmp.core import backend
from kmp.patches import registry

_BFLOAT16_SIGNIFICAND_BITS = 8  # Including the implicit leading bit.


def exact_in_bfloat16(count: int) -> bool:
    """Whether the integer `count` (> 0) is a bfloat16 number exactly.

    >>> exact_in_bfloat16(49), exact_in_bfloat16(257), exact_in_bfloat16(784)
    (True, False, True)
    """
    while count % 2 == 0:
        count //= 2
    return count < 2**_BFLOAT16_SIGNIFICAND_BITS


def _reduced_axes(shape, axis):
    """The reduced axes as a sorted tuple, or None if not static."""
    if shape.rank is None:
        return None
    if axis is None:
        return tuple(range(shape.rank))
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    if not all(
        isinstance(a, int) and -shape.rank <= a < shape.rank for a in axes
    ):
        return None
    return tuple(sorted({a % shape.rank for a in axes}))


def _bfloat16_mean(tf, x, axes, count, keepdims):
    @tf.custom_gradient
    def mean(x):
        def gradient(upstream):
            wide = tf.cast(upstream, tf.float32) / float(count)
            small = tf.cast(wide, tf.bfloat16)
            if not keepdims:
                reduced = [i in axes for i in range(x.shape.rank)]
                small = tf.reshape(small, tf.where(reduced, 1, tf.shape(x)))
            return tf.broadcast_to(small, tf.shape(x))

        return tf.reduce_mean(x, axis=axes, keepdims=keepdims), gradient

    return mean(x)


def mean(original, x, axis=None, keepdims=False):
    """Keras's `mean`, reducing bfloat16 directly when that is exact."""
    tf = backend.tensorflow()
    if isinstance(x, tf.Tensor) and x.dtype == tf.bfloat16:
        axes = _reduced_axes(x.shape, axis)
        sizes = None if axes is None else [x.shape[a] for a in axes]
        if sizes is not None and None not in sizes:
            count = math.prod(sizes)
            if count and exact_in_bfloat16(count):
                return _bfloat16_mean(tf, x, axes, count, keepdims)
    return original(x, axis=axis, keepdims=keepdims)


PATCH = registry.Patch(
    name="mean",
    kind=registry.PERFORMANCE,
    summary=(
        "keras.ops.mean reduces bfloat16 tensors without a float32 copy "
        "where the result and its gradient are Keras's (bit-identical)"
    ),
    targets=lambda: [registry.Target(_keras_tf_numpy, "mean", mean)],
    backends=("tensorflow",),
    tensorflow_versions=registry.TESTED_TENSORFLOW,
)
