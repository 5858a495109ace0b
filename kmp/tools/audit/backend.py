"""Gradients of a loss with respect to tensors and variables, any backend.

The tools (`kmp.audit`) need the gradient of a loss with respect to values
in the middle of a model, not only to its weights. That is the one thing
written per backend, in a module named after it: `tensorflow`
(`tf.GradientTape`), `jax` (`jax.value_and_grad` over the variables'
values, as `stateless_call` takes them, compiled once) and `torch`
(`torch.autograd.grad`), beside this module, which picks one at import.

`gradient_function(fn, variables)` returns `run(tensors, *inputs)`, which
calls `fn(tensors, *inputs)` -> `(loss, aux)` (reading `variables` as Keras
code does) and returns `(loss, aux, tensor_gradients, variable_gradients)`:
the gradients of the scalar `loss` with respect to each of `tensors` and of
`variables`. To get the gradient with respect to a value computed inside
`fn`, add a zero tensor from `tensors` to it there (a tap): the gradient
with respect to the tap is the gradient with respect to the value. `fn` must
be a pure function of its arguments and the variables (on JAX it is traced
once and compiled).

>>> weight = keras.Variable(3.0)
>>> def fn(tensors, x):
...     (tap,) = tensors
...     hidden = weight * x + tap
...     return hidden * hidden, hidden
>>> run = gradient_function(fn, [weight])
>>> loss, hidden, (d_hidden,), (d_weight,) = run([keras.ops.zeros(())], 2.0)
>>> float(loss), float(hidden), float(d_hidden), float(d_weight)
(36.0, 6.0, 12.0, 24.0)

`SHAPE_ERRORS` holds what the backend raises when two shapes do not fit
(a target and a model output in a loss, say).
"""

import keras  # noqa: F401 - for the example.

from kmp.core import backend

if backend.is_tensorflow():
    from kmp.tools.audit.tensorflow import SHAPE_ERRORS
    from kmp.tools.audit.tensorflow import gradient_function
elif backend.is_jax():
    from kmp.tools.audit.jax import SHAPE_ERRORS
    from kmp.tools.audit.jax import gradient_function
else:
    from kmp.tools.audit.torch import SHAPE_ERRORS
    from kmp.tools.audit.torch import gradient_function

__all__ = ["SHAPE_ERRORS", "gradient_function"]
