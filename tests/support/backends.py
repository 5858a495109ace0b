"""What the tests need to know about the Keras backend they run on.

Not a test module: the backend's name, the ways a step can run on it
(`MODES`), gradients of a loss on any backend (`gradients`), and the
module-level skip for test files that need one backend as a whole
(`require`). TensorFlow is imported only on the TensorFlow backend.
"""

import importlib

import keras
import numpy as np
import pytest

NAME = keras.backend.backend()
TENSORFLOW = NAME == "tensorflow"
JAX = NAME == "jax"
TORCH = NAME == "torch"
_READABLE = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "torch"}

# How a training step runs: eagerly, traced into a graph, compiled by XLA.
# On JAX "jit" is `jax.jit` over the stateless API (what `fit` does by
# default); torch runs eagerly (torch.compile is not tested).
MODES = {
    "tensorflow": ["eager", "tf_function", "jit"],
    "jax": ["eager", "jit"],
    "torch": ["eager"],
}[NAME]
# The modes in which stateful Python (`optimizer.apply_gradients`) can run:
# all but JAX's jit, which takes a step over the stateless API.
STATEFUL_MODES = [mode for mode in MODES if not (JAX and mode == "jit")]
# JAX computes in 32 bits unless x64 is enabled (Keras does not).
HAS_FLOAT64 = not JAX or bool(
    importlib.import_module("jax").config.jax_enable_x64
)
FLOAT_DTYPES = ["float16", "bfloat16", "float32"] + (
    ["float64"] if HAS_FLOAT64 else []
)
# The mode `model.fit` uses when compiled with its defaults.
DEFAULT_FIT_MODE = {
    "tensorflow": "tf_function",
    "jax": "jit",
    "torch": "eager",
}[NAME]


def modes(*names):
    """Those of `names` that this backend has (see `MODES`)."""
    return [name for name in names if name in MODES]


def require(*backends):
    """Skips the calling test module unless Keras runs on one of `backends`.

    Called at the top of a module, before it imports anything that needs
    the backend (TensorFlow, say).
    """
    if NAME not in backends:
        needs = " or ".join(_READABLE[name] for name in backends)
        pytest.skip(
            f"{needs} backend only (Keras runs on {NAME})",
            allow_module_level=True,
        )


def tensorflow():
    """The `tensorflow` module (only called on the TensorFlow backend)."""
    assert TENSORFLOW, f"TensorFlow needed, Keras runs on {NAME}"
    return importlib.import_module("tensorflow")


def tensor(value, dtype="float32"):
    """A backend tensor of `value` in `dtype`."""
    return keras.ops.convert_to_tensor(np.asarray(value, dtype), dtype)


def dtype(value) -> str:
    """The dtype name of a tensor, array or variable (`"float32"`)."""
    return keras.backend.standardize_dtype(value.dtype)


def native_dtype(name: str):
    """The backend's own dtype object for `name` (`tf.float16`, ...)."""
    if TENSORFLOW:
        return tensorflow().as_dtype(name)
    if JAX:
        import jax.numpy as jnp

        return getattr(jnp, name)
    import torch

    return getattr(torch, name)


def gradients(loss_fn, variables):
    """The gradients of `loss_fn()` (a scalar) with respect to `variables`.

    `loss_fn` reads the variables as Keras code does (`model(x)`); the
    gradients come back in the variables' order. A variable the loss does
    not depend on gets None on TensorFlow and torch, zeros on JAX. On
    TensorFlow this also runs inside a `tf.function`; on torch it is
    `loss.backward()`; on JAX `jax.grad` over the variables' values.
    """
    variables = list(variables)
    if TENSORFLOW:
        tf = tensorflow()
        with tf.GradientTape() as tape:
            loss = loss_fn()
        return list(tape.gradient(loss, variables))
    if JAX:
        import jax
        from keras.src.backend.common.stateless_scope import StatelessScope

        def loss_of(values):
            with StatelessScope(state_mapping=list(zip(variables, values))):
                return loss_fn()

        return list(jax.grad(loss_of)([v.value for v in variables]))
    for variable in variables:
        variable.value.grad = None
    loss_fn().backward()
    grads = [variable.value.grad for variable in variables]
    for variable in variables:
        variable.value.grad = None
    return grads


def global_norm_clip(grads, clip_norm):
    """`tf.clip_by_global_norm(grads, clip_norm)[0]` in `keras.ops`."""
    ops = keras.ops
    norm = ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))
    factor = ops.minimum(1.0, clip_norm / norm)
    return [g * factor for g in grads]


def buffer_addresses(model) -> set:
    """The addresses of `model`'s variable buffers, to check that two models
    share none (JAX and torch; a TensorFlow variable always holds its own,
    so the set is empty there)."""
    if JAX:
        return {v.value.unsafe_buffer_pointer() for v in model.weights}
    if TORCH:
        return {v.value.data_ptr() for v in model.weights}
    return set()
