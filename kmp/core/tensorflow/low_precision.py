"""How `LowPrecisionOptimizer` applies a step on TensorFlow.

Two things only TensorFlow needs:

* `tf.distribute`: the wrapper sums the gradients across replicas once
  (where `kmp.LossScaleOptimizer` can turn that off, having summed them
  itself); the inner optimizer's own `_backend_update_step` then applies
  them as they are, with its per-replica updates, which call the update
  step the wrapper lends it (`kmp.core.borrow`) for each variable.
* XLA for large variables: their float32 arithmetic on low-precision state
  is compiled, so no float32 temporaries the size of the variable are made
  (on the 20M-parameter MLP, 220 MB of them at the step's peak).
"""

import functools

from kmp.core import backend
from kmp.core import borrow
from kmp.core.low_bit import codes
from kmp.core.low_bit import parts
from kmp.core.low_bit import rounding
from kmp.core.low_bit import shared_step as shared
from kmp.core.tensorflow import parts_in_place
from kmp.core.tensorflow import rounding as tf_rounding
from kmp.core.tensorflow import step as tf_step

tf = backend.tensorflow()

# Smaller variables' temporaries are small; compiling each would cost more.
COMPILE_MIN_ELEMENTS = 2**16
# TensorFlow's XLA widens a bfloat16 array's in-place update in a loop to
# float32 and back, whole, at every part: the weights and compensation are
# carried as their bits (the 42M MLP's update: 19.7x float32 AdamW's
# carried as bfloat16, measured).
SIXTEEN_BIT_AS_BITS = True


def apply_update(optimizer, grads, variables):
    """Sums `grads` over replicas (unless lent otherwise) and applies them."""
    inner = optimizer.inner_optimizer
    pairs = optimizer._all_reduce_sum_gradients(list(zip(grads, variables)))
    with borrow.lent(
        inner,
        update_step=optimizer._update_step,
        _all_reduce_sum_gradients=list,
    ):
        inner._backend_update_step(
            [g for g, _ in pairs], [v for _, v in pairs], inner.learning_rate
        )


def sum_over_replicas(grads_and_vars):
    """The pairs with their gradients summed over `tf.distribute`
    replicas, one all-reduce per dtype."""
    pairs = list(grads_and_vars)
    grads = tf_step.sum_over_replicas([g for g, _ in pairs])
    return [(g, v) for g, (_, v) in zip(grads, pairs)]


def update_variable(optimizer, gradient, learning_rate, variable, index):
    """One variable's update; compiled with XLA for a large one."""
    size = variable.shape.num_elements() or 0
    low = (
        rounding.is_low(variable.dtype)
        or optimizer.quantized
        or rounding.is_low(optimizer.slot_dtype)
    )
    if not low or size < COMPILE_MIN_ELEMENTS:
        optimizer._update_one(gradient, learning_rate, variable, index)
        return
    dtype = None
    bounds = parts.bounds(optimizer, index, update_in_parts)
    if bounds is not None:
        if not tf_step.in_xla_context() and parts_in_place.in_place_layout(
            optimizer, variable, index, bounds
        ):
            parts_in_place.update_in_place(
                optimizer,
                gradient,
                tf.cast(tf.convert_to_tensor(learning_rate), tf.float32),
                variable,
                index,
                bounds,
            )
            return
        gradient = dense_gradient(gradient, variable)
        if rounding.is_low(gradient.dtype):
            # Its bits, viewed here (free); inside XLA the view of a
            # 16-bit float array is a copy, and a 16-bit gradient sliced
            # in the loop was made float32 whole.
            dtype = gradient.dtype
            gradient = tf.bitcast(gradient, tf.uint16)
    key = (index, id(variable))
    if key not in optimizer._compiled:
        optimizer._compiled[key] = tf.function(
            functools.partial(
                _compiled_update, optimizer, variable=variable, index=index
            ),
            jit_compile=True,
            autograph=False,
        )
    optimizer._compiled[key](
        gradient,
        tf.cast(tf.convert_to_tensor(learning_rate), tf.float32),
        dtype=dtype,
    )


def _compiled_update(
    optimizer, gradient, learning_rate, variable, index, dtype=None
):
    """A large variable's update, compiled: in parts from its gradient's
    bits (`dtype`: the gradient's), or as `_update_one`."""
    if dtype is None:
        optimizer._update_one(gradient, learning_rate, variable, index)
        return
    bounds = parts.bounds(optimizer, index, update_in_parts)
    shared.update_in_parts(
        optimizer,
        gradient,
        learning_rate,
        variable,
        index,
        bounds,
        sixteen_bit_as_bits=SIXTEEN_BIT_AS_BITS,
        gradient_dtype=dtype,
    )


# The float32 stand-in for a quantized slot, and how a value finds its code
# (elementwise: XLA fuses it; TensorFlow's graph runs it as it is).
slot_view = tf_rounding.DequantizedView
nearest_code = codes.nearest


def update_in_parts(
    optimizer, gradient, learning_rate, variable, index, bounds
):
    """A large variable's update with quantized slots in parts
    (`kmp.core.low_bit.parts`), inside its compiled update: a `tf.while_loop`
    carrying the flat arrays (`kmp.core.low_bit.shared_step`).

    The parts slice the gradient flat, so a sparse one (`tf.IndexedSlices`:
    an `Embedding`'s rows) is made dense first, in the variable's shape
    (`dense_gradient`).
    """
    shared.update_in_parts(
        optimizer,
        dense_gradient(gradient, variable),
        learning_rate,
        variable,
        index,
        bounds,
    )


def dense_gradient(gradient, variable):
    """`gradient` as a dense tensor of `variable`'s static shape.

    A `tf.IndexedSlices` is summed into its rows as `tf.convert_to_tensor`
    does (`tf.math.unsorted_segment_sum`), but over the variable's own
    number of rows: inside the compiled update its `dense_shape` is a
    traced tensor, so `tf.convert_to_tensor` gives a first axis of unknown
    size, which `keras.ops.view` cannot take (it tests the size in Python).
    Keras's update of the variable whole squares a sparse gradient's rows
    before a row met more than once is summed (`keras.ops.square` keeps
    it sparse); here, as on JAX and torch, the summed row is squared.
    """
    shape = tuple(variable.shape)
    if isinstance(gradient, tf.IndexedSlices):
        gradient = tf.math.unsorted_segment_sum(
            gradient.values, gradient.indices, shape[0]
        )
    return tf.reshape(gradient, shape)


def slot_part_view(slot, part):
    """The float32 stand-in for `part` of a quantized slot."""
    return tf_rounding.DequantizedPartView(slot, part)


def plain_part_view(slot, part):
    """The stand-in for `part` of a plain slot (in its own dtype)."""
    return tf_rounding.PlainPartView(slot, part)


def part_view(optimizer, variable, model_variable, compensation, dtype, part):
    """The float32 stand-in for `part` of `variable`
    (`kmp.core.low_bit.parts`)."""
    return tf_rounding.PartView(
        variable,
        model_variable,
        compensation,
        optimizer.inner_optimizer._var_key(variable),
        dtype,
        part,
    )


def view(optimizer, variable, model_variable, compensation, dtype):
    """The float32 stand-in for `variable` (a `tf.Variable` here, one
    replica's under `tf.distribute`) in the inner `update_step`."""
    return tf_rounding.Float32View(
        variable,
        model_variable,
        None if compensation is None else compensation.value,
        optimizer.inner_optimizer._var_key(variable),
        dtype,
    )
