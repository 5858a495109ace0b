"""What every backend's `LowPrecisionOptimizer` step shares.

`routed_update` runs an inner optimizer's own update with its
`update_step` lent by the `LowPrecisionOptimizer` (JAX, torch); the
defaults `update_variable` and `view` are JAX's and torch's, where the
float32 stand-in is `kmp.core.rounding.Float32View` (TensorFlow's are in
`kmp.core.tensorflow.low_precision`).
"""

import keras
from keras import ops

from kmp.core import borrow
from kmp.core import quantization
from kmp.core import rounding


def routed_update(optimizer, grads, variables, backend_update_step):
    """Runs `backend_update_step` (the inner optimizer's, or a form of it)
    with its `update_step` lent by `optimizer` (JAX, torch)."""
    inner = optimizer.inner_optimizer
    with borrow.lent(
        inner,
        update_step=optimizer._update_step,
        _var_key=optimizer._inner_var_key,
    ):
        backend_update_step(grads, variables, inner.learning_rate)


def update_variable(optimizer, gradient, learning_rate, variable, index):
    """One variable's update (`LowPrecisionOptimizer._update_step`)."""
    optimizer._update_one(gradient, learning_rate, variable, index)


def view(optimizer, variable, model_variable, compensation, dtype):
    """The float32 stand-in for `variable` in the inner `update_step`."""
    return rounding.Float32View(model_variable, compensation, dtype)


def clip_gradients(inner, grads):
    """`inner`'s clipping; a global norm of gradients of several dtypes
    (bfloat16 layers and a float32 output layer) is taken in float32.

    Keras's global norm adds the squared norms of all gradients, which it
    cannot do across dtypes; there the gradients go on in float32, which
    the float32 update reads anyway. Gradients of one dtype are clipped by
    Keras as they are.
    """
    if not inner.global_clipnorm:
        return inner._clip_gradients(grads)
    dtypes = {rounding.dtype_name(g.dtype) for g in grads if g is not None}
    if len(dtypes) > 1:
        wide = keras.backend.result_type(*dtypes, "float32")
        grads = [g if g is None else ops.cast(g, wide) for g in grads]
    return inner._clip_gradients(grads)


# The float32 stand-in for an 8-bit slot, and how a value finds its code
# (elementwise: XLA fuses it, on JAX and TensorFlow).
slot_view = rounding.DequantizedView
nearest_code = quantization.nearest_code

__all__ = [
    "clip_gradients",
    "nearest_code",
    "routed_update",
    "slot_view",
    "update_variable",
    "view",
]
