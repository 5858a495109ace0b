"""Means of bfloat16 tensors without a float32 copy of the whole input.

Keras 3's `keras.ops.mean` on TensorFlow casts a low-precision input to
float32, reduces, and casts the result back, because TensorFlow's float16
mean could overflow. Under `mixed_bfloat16` that float32 copy, and the float32
gradient of the same size in the backward pass, are the largest tensors of
layers such as `GlobalAveragePooling2D`: on the benchmark CNN they are why
bfloat16 training needed 0.63x of float32's memory, where Keras 2 needed
0.52-0.56x (`python benchmarks/memory_breakdown.py --models cnn`).

bfloat16 has float32's range, so it cannot overflow there, and TensorFlow's
own bfloat16 mean already adds up in float32, without materialising a float32
copy. `install()` makes `keras.ops.mean` use it for bfloat16 tensors whenever
the result is bit-identical to Keras's, forward and backward: a dense tensor
whose reduced element count is known and exactly representable in bfloat16
(every count up to 256, and e.g. 1024 = 32 x 32 or 784 = 28 x 28). The
gradient then divides by that count in bfloat16 exactly as Keras's float32
gradient rounded to bfloat16 does. Every other input (float16, float32,
integers, sparse tensors, other counts) goes to Keras's own `mean`.
Importing kmp installs it; `uninstall()` restores Keras's function.
"""

import math

from keras.src.backend.tensorflow import numpy as _keras_tf_numpy

from kmp._backend import tf
from kmp._patch import Patch

_BFLOAT16_SIGNIFICAND_BITS = 8  # Including the implicit leading bit.


def _exact_in_bfloat16(count: int) -> bool:
    """Whether the integer `count` (> 0) is a bfloat16 number exactly."""
    while count % 2 == 0:
        count //= 2
    return count < 2**_BFLOAT16_SIGNIFICAND_BITS


def _reduced_count(shape, axis):
    """How many elements each output element averages; None if unknown."""
    if shape.rank is None:
        return None
    if axis is None:
        axes = range(shape.rank)
    else:
        axes = axis if isinstance(axis, (list, tuple)) else [axis]
        if not all(
            isinstance(a, int) and -shape.rank <= a < shape.rank for a in axes
        ):
            return None
        axes = {a % shape.rank for a in axes}
    sizes = [shape[a] for a in axes]
    if any(size is None for size in sizes):
        return None
    return math.prod(sizes)


def _mean(x, axis=None, keepdims=False):
    """Keras's `mean`, reducing bfloat16 directly when that is exact."""
    if isinstance(x, tf.Tensor) and x.dtype == tf.bfloat16:
        count = _reduced_count(x.shape, axis)
        if count and _exact_in_bfloat16(count):
            return tf.reduce_mean(x, axis=axis, keepdims=keepdims)
    return _patch.original(x, axis=axis, keepdims=keepdims)


_patch = Patch(_keras_tf_numpy, "mean", _mean)


def install() -> None:
    """Makes `keras.ops.mean` reduce bfloat16 tensors without a float32 copy.

    Only where the result is bit-identical to Keras's (see the module
    docstring); from the next trace on. Calling it again does nothing.

    Example:

    >>> install()  # importing kmp already did
    >>> is_installed()
    True
    """
    _patch.install()


def uninstall() -> None:
    """Gives `keras.ops.mean` Keras's own function back.

    Example:

    >>> uninstall()
    >>> is_installed()
    False
    >>> install()  # as importing kmp left it
    """
    _patch.uninstall()


def is_installed() -> bool:
    """Whether `install()` is in effect.

    Example:

    >>> is_installed() in (True, False)
    True
    """
    return _patch.installed
