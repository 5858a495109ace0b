"""How `LowPrecisionOptimizer` applies a step on torch.

Keras's torch optimizers (Adam, SGD, RMSprop and others) apply a step to
all variables at once with `torch._foreach` operations, in the variables'
and slots' own dtypes, and never call `update_step`. Where no variable is
low-precision and the slots are not either, that fused update is applied
as it is (bit for bit Keras's). Otherwise every variable gets the
optimizer's `keras.ops` update (its `update_step`, the same formulas as the
fused one) on a float32 stand-in, as on the other backends, so that no
arithmetic happens in bfloat16. Nothing is recorded for autograd.
"""

import functools

import keras
import torch
from keras import ops
from keras.src.backend.common.stateless_scope import in_stateless_scope

from kmp.core import borrow
from kmp.core.low_bit import parts
from kmp.core.low_bit import rounding
from kmp.core.low_bit import shared_step as shared
from kmp.core.torch import codes as torch_codes
from kmp.core.torch import compiled

update_variable = shared.update_variable
view = shared.view
slot_view = shared.slot_view
part_view = shared.part_view
slot_part_view = shared.slot_part_view
plain_part_view = shared.plain_part_view


def update_in_parts(
    optimizer, gradient, learning_rate, variable, index, bounds
):
    """Variable `index`'s update in parts (`kmp.core.low_bit.parts`), one after
    another, each written in place (in a stateless scope, into new values:
    the scope's tensors are the caller's)."""
    flat_gradient = gradient.reshape(-1)
    stateless = in_stateless_scope()

    def read(target):
        return target.value.reshape(-1)

    def write(target, offset, value):
        if stateless:
            flat = ops.slice_update(
                read(target), (offset,), ops.cast(value, target.dtype)
            )
            optimizer.assign(target, flat.reshape(tuple(target.shape)))
        else:
            read(target)[offset : offset + value.numel()].copy_(value)

    for start, stop in bounds:
        part = parts.Part(start, stop - start, read, write)
        optimizer._update_part(
            flat_gradient[start:stop], learning_rate, variable, index, part
        )


# The nearest code to each value, in torch's forms.
nearest_code = torch_codes.nearest


def apply_update(optimizer, grads, variables):
    """Applies the (clipped) gradients."""
    inner = optimizer.inner_optimizer
    with torch.no_grad():
        slot_dtype = optimizer.slot_dtype
        if not optimizer.quantized and not any(
            rounding.is_low(dtype)
            for dtype in [slot_dtype, *(v.dtype for v in variables)]
        ):
            inner._apply_weight_decay(variables)
            inner._backend_update_step(grads, variables, inner.learning_rate)
            for variable in variables:
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))
            return
        step = _per_variable_update_step(type(inner))
        if step is _KERAS_LOOP:  # Adam, AdamW: each variable on its own.
            grads, variables, tails = compiled.apply(
                optimizer, grads, variables, inner.learning_rate
            )
            if tails:
                with borrow.lent(inner, _var_key=optimizer._inner_var_key):
                    for gradient, variable, index, bounds in tails:
                        update_in_parts(
                            optimizer,
                            gradient,
                            inner.learning_rate,
                            variable,
                            index,
                            bounds,
                        )
            if not variables:
                return
        shared.routed_update(
            optimizer, grads, variables, functools.partial(step, inner)
        )


# Keras's `_backend_update_step`: `update_step` for each variable, nothing
# more per step.
_KERAS_LOOP = keras.optimizers.Optimizer._backend_update_step


def _per_variable_update_step(optimizer_class):
    """The `_backend_update_step` of `optimizer_class` that calls
    `update_step` for each variable: the first in its method resolution
    order that is not a fused one (Keras's torch-specific `_foreach` ones,
    `kmp.core.torch.fused`'s kernels)."""
    for klass in optimizer_class.__mro__:
        method = vars(klass).get("_backend_update_step")
        if method is not None and not klass.__module__.startswith(
            ("keras.src.backend.torch", "kmp.core.torch.fused")
        ):
            return method
    raise TypeError(
        f"{optimizer_class.__name__} has no per-variable update step."
    )
