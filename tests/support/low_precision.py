"""Helpers shared by the LowPrecisionOptimizer tests on every backend.

Not a test module: variables as NumPy, a step of an optimizer in a mode
(`tests.support.backends.MODES`; on JAX "jit" is `stateless_apply` in
`jax.jit`), and the small bfloat16 classifier and data the tests train.
"""

import keras
import ml_dtypes
import numpy as np

import kmp
from tests.support import backends

BF16 = ml_dtypes.bfloat16
ops = keras.ops


def numpy_of(value, dtype=None):
    """A variable or tensor as NumPy (bfloat16 as ml_dtypes' bfloat16)."""
    array = np.asarray(ops.convert_to_numpy(value))
    if backends.dtype(value) == "bfloat16":
        array = array.astype(BF16)
    return array if dtype is None else array.astype(dtype)


def compiled(function, mode):
    """A pure `function` in `mode`: as it is, `tf.function` or `jax.jit`."""
    if mode == "eager":
        return function
    if backends.JAX:
        import jax

        return jax.jit(function)
    tf = backends.tensorflow()
    return tf.function(function, jit_compile=mode == "jit")


def stepper(optimizer, variables, mode):
    """`step(gradients)`: one `apply_gradients` of `optimizer` (built on
    `variables`) in `mode`; on JAX "jit" `stateless_apply` in `jax.jit`,
    its results assigned back."""
    if backends.JAX and mode == "jit":
        import jax

        apply = jax.jit(optimizer.stateless_apply)

        def jax_step(gradients):
            new, state = apply(
                [v.value for v in optimizer.variables],
                list(gradients),
                [v.value for v in variables],
            )
            for variable, value in zip(variables, new):
                variable.assign(value)
            for variable, value in zip(optimizer.variables, state):
                variable.assign(value)

        return jax_step

    def step(gradients):
        optimizer.apply_gradients(zip(gradients, variables))

    if mode == "eager":
        return step
    tf = backends.tensorflow()
    return tf.function(step, jit_compile=mode == "jit")


def digits_like(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96, 8)).astype("float32")
    return x, (x[:, :3].sum(axis=1) > 0).astype("int32")


def bfloat16_model():
    with kmp.policy_scope("bfloat16"):
        keras.utils.set_random_seed(1)
        return keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
                keras.layers.Activation("linear", dtype="float32"),
            ]
        )


def logits_loss(**kwargs):
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, **kwargs
    )


def state(model, optimizer):
    return [numpy_of(v).copy() for v in model.trainable_variables] + [
        numpy_of(v).copy() for v in optimizer.variables
    ]
