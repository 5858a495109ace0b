"""What every backend's `LowPrecisionOptimizer` step shares.

`routed_update` runs an inner optimizer's own update with its
`update_step` lent by the `LowPrecisionOptimizer` (JAX, torch); the
defaults `update_variable` and `view` are JAX's and torch's, where the
float32 stand-in is `kmp.core.low_bit.rounding.Float32View` (TensorFlow's are in
`kmp.core.tensorflow.low_precision`).
"""

import keras
from keras import ops

from kmp.core import borrow
from kmp.core.low_bit import codes
from kmp.core.low_bit import parts
from kmp.core.low_bit import rounding


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


def part_view(optimizer, variable, model_variable, compensation, dtype, part):
    """The float32 stand-in for `part` of `variable`
    (`kmp.core.low_bit.parts`)."""
    return rounding.PartView(model_variable, compensation, dtype, part)


def slot_part_view(slot, part):
    """The float32 stand-in for `part` of a quantized slot."""
    return rounding.DequantizedPartView(slot, part)


def plain_part_view(slot, part):
    """The stand-in for `part` of a plain slot (in its own dtype)."""
    return rounding.PlainPartView(slot, part)


def update_in_parts(
    optimizer,
    gradient,
    learning_rate,
    variable,
    index,
    bounds,
    sixteen_bit_as_bits=True,
    gradient_dtype=None,
):
    """Variable `index`'s update in parts (`kmp.core.low_bit.parts`; JAX and
    TensorFlow): a loop (`ops.fori_loop`) over the whole parts, carrying
    the flat arrays they write (`ops.slice_update`, in place under XLA),
    then the last, shorter one; each array assigned once, at the end.

    The loop also carries the next part's slice of each quantized slot's
    codes and scales, read from the arrays after this part's writes: a
    part's update reads its old codes twice (decoding its moments, and
    again in the fusion that updates the weights), and where it read them
    from the carried arrays, nothing ordered that second read before the
    codes' in-place write, so XLA copied the whole codes and scales at
    every part (a 4096x4096 kernel's update: 16 parts, four copies of
    16 MB each). A part decodes its carried slice instead
    (`tests/core/jax/test_parts_copies.py`).
    """
    model_variable = optimizer._trainable_variables[index]
    targets = parts.targets(optimizer, variable, index)
    owners = {}
    for _, slot in optimizer._located.get(index, ()):
        owners[id(slot.codes)], owners[id(slot.scales)] = (slot, 0), (slot, 1)
    # Target number: (slot, 0 for its codes or 1 its scales).
    extents = {
        n: owners[id(t)] for n, t in enumerate(targets) if id(t) in owners
    }
    keys = {id(t): n for n, t in enumerate(targets)}
    keys[id(model_variable)] = 0  # On TensorFlow `variable` may differ.

    def as_bits(dtype):
        return sixteen_bit_as_bits and rounding.is_low(dtype)

    if gradient_dtype is None:
        gradient_dtype = rounding.dtype_name(gradient.dtype)
        gradient_bits = "uint16" if as_bits(gradient_dtype) else None
        gradient_bits = gradient_bits or gradient_dtype
        flat_gradient = ops.view(ops.reshape(gradient, (-1,)), gradient_bits)
    else:
        gradient_dtype = rounding.dtype_name(gradient_dtype)
        gradient_bits = "uint16"
        flat_gradient = ops.reshape(gradient, (-1,))
    length = bounds[0][1] - bounds[0][0]
    whole = [b for b in bounds if b[1] - b[0] == length]

    # 16-bit floats are carried as their bits: XLA's CPU backend widens a
    # bfloat16 array's update to float32 and back, whole, at every part.
    dtypes = [rounding.dtype_name(t.dtype) for t in targets]
    carried = ["uint16" if as_bits(d) else d for d in dtypes]

    def extent(n, start, size):
        slot, which = extents[n]
        return parts.slot_extent(slot, start, size)[which]

    def stage(values, start):
        """The whole part at `start`'s slice of each slot array (at the
        end of the arrays for a part past them)."""
        staged = []
        for n in extents:
            offset, count = extent(n, start, length)
            total = int(values[n].shape[0])
            offset = ops.minimum(offset, total - count)
            staged.append(ops.slice(values[n], (offset,), (count,)))
        return tuple(staged)

    def run(values, staged, start, size):
        values = list(values)
        own = dict(zip(extents, staged))

        def read(target):
            n = keys[id(target)]
            if carried[n] == dtypes[n]:
                return values[n]
            return ops.view(values[n], dtypes[n])

        def write(target, offset, value):
            n = keys[id(target)]
            value = ops.cast(value, dtypes[n])
            if carried[n] != dtypes[n]:
                value = ops.view(value, carried[n])
            values[n] = ops.slice_update(values[n], (offset,), value)

        part = parts.Part(
            start, size, read, write, lambda target: own[keys[id(target)]]
        )
        part_gradient = ops.slice(flat_gradient, (start,), (size,))
        if gradient_dtype != gradient_bits:
            part_gradient = ops.view(part_gradient, gradient_dtype)
        optimizer._update_part(
            part_gradient, learning_rate, variable, index, part
        )
        return tuple(values)

    def body(i, carry):
        values = run(*carry, i * length, length)
        return values, stage(values, (i + 1) * length)

    values = tuple(
        ops.view(ops.reshape(ops.convert_to_tensor(t), (-1,)), c)
        for t, c in zip(targets, carried)
    )
    values, staged = ops.fori_loop(
        0, len(whole), body, (values, stage(values, 0))
    )
    for start, stop in bounds[len(whole) :]:
        # The last part ends where the arrays do: its slices are the ends
        # of those the loop staged last.
        tail = []
        for n, slices in zip(extents, staged):
            count = extent(n, start, stop - start)[1]
            tail.append(
                ops.slice(slices, (int(slices.shape[0]) - count,), (count,))
            )
        values = run(values, tail, start, stop - start)
    values = [ops.view(v, d) for v, d in zip(values, dtypes)]
    for target, value in zip(targets, values):
        optimizer.assign(target, ops.reshape(value, tuple(target.shape)))


# The float32 stand-in for a quantized slot, and how a value finds its code
# (elementwise: XLA fuses it, on JAX and TensorFlow).
slot_view = rounding.DequantizedView
nearest_code = codes.nearest

__all__ = [
    "clip_gradients",
    "part_view",
    "plain_part_view",
    "slot_part_view",
    "update_in_parts",
    "nearest_code",
    "routed_update",
    "slot_view",
    "update_variable",
    "view",
]
