"""Gradients on JAX, for the tools: `jax.value_and_grad`, jitted.

JAX differentiates functions, not tensors: the variables' values are
passed in and mapped onto the variables with a Keras `StatelessScope`, as
`stateless_call` does. The function is compiled once (`jax.jit`) and
reused for inputs of the same shapes: run eagerly, JAX would compile each
op of the forward and backward pass on its own. `gradient_function` is
what `kmp.tools.audit.backend` picks on this backend.
"""

import jax
from keras.src.backend.common.stateless_scope import StatelessScope

# What a loss raises when a target does not fit an output (jax.numpy's
# broadcasting: ValueError; lax's shape checks: TypeError).
SHAPE_ERRORS = (ValueError, TypeError)


def gradient_function(fn, variables):
    """See `kmp.tools.audit.backend.gradient_function`. JAX gives zeros (never
    None) where the loss does not depend on a value; `variables` must hold
    each variable once."""
    variables = list(variables)

    def pure(tensor_values, variable_values, inputs):
        mapping = list(zip(variables, variable_values))
        with StatelessScope(state_mapping=mapping):
            return fn(tensor_values, *inputs)

    step = jax.jit(jax.value_and_grad(pure, argnums=(0, 1), has_aux=True))

    def run(tensors, *inputs):
        values = [variable.value for variable in variables]
        (loss, aux), (tensor_gradients, variable_gradients) = step(
            list(tensors), values, inputs
        )
        return loss, aux, list(tensor_gradients), list(variable_gradients)

    return run


__all__ = ["SHAPE_ERRORS", "gradient_function"]
