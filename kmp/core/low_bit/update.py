"""A `LowPrecisionOptimizer`'s update of one variable, or of one part of it.

The inner optimizer's own `update_step` runs on float32 stand-ins: for the
variable (`kmp.core.low_bit.rounding.Float32View`, or its part's), for its
quantized slots (decoded, `kmp.core.low_bit.slots`) and, in parts, for its
plain slots (`kmp.core.low_bit.parts`); what it wrote is then encoded into
the slots and rounded into the variable (Kahan summation, stochastic
rounding or to nearest). Each backend's step module
(`kmp.core.<backend>.low_precision`) gives the stand-ins and how a value
finds its code; `kmp.core.low_precision.LowPrecisionOptimizer` passes it.
"""

import keras
from keras import ops

from kmp.core.low_bit import parts
from kmp.core.low_bit import rounding
from kmp.core.low_bit import slots as quantized_slots

_KERAS_WEIGHT_DECAY = keras.optimizers.Optimizer._apply_weight_decay


def update_part(
    optimizer, steps, gradient, learning_rate, variable, index, part=None
):
    """Variable `index`'s update by `optimizer` (a `LowPrecisionOptimizer`),
    or that of `part` of it (flat: a `kmp.core.low_bit.parts.Part`, whose
    `write` writes the results); `steps` is the backend's step module
    (`kmp.core.<backend>.low_precision`): its views and code finder."""
    inner = optimizer._inner_optimizer
    model_variable = optimizer._trainable_variables[index]
    low = rounding.is_low(variable.dtype)
    compensation = optimizer._compensations[index]
    dtype = "float32" if low else rounding.dtype_name(variable.dtype)
    if part is None:
        view = steps.view(
            optimizer, variable, model_variable, compensation, dtype
        )
        slot_view, write = steps.slot_view, optimizer.assign
        plain_view = None
    else:
        view = steps.part_view(
            optimizer, variable, model_variable, compensation, dtype, part
        )

        def slot_view(slot):
            return steps.slot_part_view(slot, part)

        def plain_view(slot):
            return steps.plain_part_view(slot, part)

        def write(target, value):
            part.write(target, part.start, value)

    decay(optimizer, view, model_variable, learning_rate)
    plain = {} if part is None else optimizer._plain_slots
    with (
        quantized_slots.views(optimizer._located, index, slot_view) as pairs,
        parts.plain_views(plain, index, plain_view) as plains,
    ):
        type(inner).update_step(inner, gradient, view, learning_rate)
    if part is None:
        quantized_slots.write_back(optimizer, pairs, steps.nearest_code)
    else:
        parts.write_back(pairs, steps.nearest_code, part)
        parts.write_plain(plains, part)
    if not view.written:
        return
    value = view.value
    constraint = getattr(model_variable, "constraint", None)
    if constraint is not None:  # Never in parts (kmp.core.low_bit.parts).
        value = constraint(value)
    if not low:
        write(variable, value)
    elif optimizer._rounding == "stochastic":
        seed = optimizer._streams.step_seed(
            optimizer._seed.value, inner._iterations.value, index
        )
        where = None if part is None else part.start
        noisy = rounding.stochastic_round(
            value, variable.dtype, seed, optimizer._streams, where
        )
        write(variable, noisy)
    else:
        rounded = ops.cast(value, variable.dtype)
        write(variable, rounded)
        if compensation is not None:
            write(compensation, value - ops.cast(rounded, "float32"))


def decay(optimizer, view, model_variable, learning_rate):
    """The inner optimizer's weight decay, on the float32 view."""
    inner = optimizer._inner_optimizer
    if type(inner)._apply_weight_decay is not _KERAS_WEIGHT_DECAY:
        # Written for plain variables (Muon): it runs on the view as is.
        inner._apply_weight_decay([view])
    elif inner.weight_decay is not None and inner._use_weight_decay(
        model_variable
    ):
        weight_decay = ops.cast(inner.weight_decay, view.dtype)
        rate = ops.cast(learning_rate, view.dtype)
        view.assign_sub(view.value * weight_decay * rate)
