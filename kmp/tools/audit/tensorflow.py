"""Gradients on TensorFlow, for the tools: `tf.GradientTape`.

`gradient_function` is what `kmp.tools.audit.backend` picks on this backend
(`jax` and `torch` beside it hold the others).
"""

from kmp.core import backend

tf = backend.tensorflow()

# What a loss raises when a target does not fit an output.
SHAPE_ERRORS = (ValueError, tf.errors.InvalidArgumentError)


def gradient_function(fn, variables):
    """See `kmp.tools.audit.backend.gradient_function`. Gradients are dense (a
    `tf.IndexedSlices`, from an embedding, is converted); None where the
    loss does not depend on the value."""
    variables = list(variables)

    def run(tensors, *inputs):
        tensors = list(tensors)
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            loss, aux = fn(tensors, *inputs)
        tensor_gradients, variable_gradients = tape.gradient(
            loss, [tensors, variables]
        )
        variable_gradients = [
            None if g is None else tf.convert_to_tensor(g)
            for g in variable_gradients
        ]
        return loss, aux, list(tensor_gradients), variable_gradients

    return run


__all__ = ["SHAPE_ERRORS", "gradient_function"]
