"""What the adversarial tests share: snapshots, bit comparisons, tiny models.

The adversarial suite tests kmp as a stranger would, from the contract
(/work/shared/CONTRACT.md) and the public docstrings only. Every test ends in
one of two assertions: a clear TypeError / ValueError at the user's call with
every optimizer and model variable unchanged (`refused`), or a result equal
bit for bit to a float32 reference (`assert_bits_equal`).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from tests.support.bits import assert_bits_equal
from tests.support.bits import values

LSO = kmp.LossScaleOptimizer
MODES = ["eager", "tf_function", "jit"]


@contextlib.contextmanager
def refused(error, match=None, *objects):
    """Asserts the block raises `error` (matching `match`) and leaves every
    variable of `objects` exactly as it was."""
    before = values(*objects)
    with pytest.raises(error, match=match) as info:
        yield info
    assert_bits_equal(values(*objects), before, "variable after refusal")


def variable_named(optimizer, name):
    (found,) = [v for v in optimizer.variables if v.name == name]
    return found


def scale_of(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.loss_scale))


def data(shape, seed):
    """Normal float32 data (far from subnormals: scaling by a power of two
    is then exact in every product and sum of a small model)."""
    values = np.random.default_rng(seed).normal(size=shape)
    return tf.constant(values.astype("float32"))


def dense_model(units=(4, 2), inputs=3, seed=0, dtype=None):
    """A tiny Sequential of Dense layers with fixed, seeded weights."""
    layers = [keras.Input((inputs,))]
    for index, unit in enumerate(units):
        layers.append(
            keras.layers.Dense(
                unit,
                activation="relu" if index < len(units) - 1 else None,
                kernel_initializer=keras.initializers.RandomNormal(
                    seed=seed + index
                ),
                bias_initializer=keras.initializers.RandomNormal(
                    seed=seed + 100 + index
                ),
                dtype=dtype,
            )
        )
    return keras.Sequential(layers)


def mse(model, x, y):
    prediction = keras.ops.cast(model(x, training=True), "float32")
    return keras.ops.mean((prediction - y) ** 2)


def compile_mode(function, mode):
    """`function` as is (eager), in a tf.function, or compiled by XLA."""
    if mode == "eager":
        return function
    return tf.function(function, jit_compile=(mode == "jit"))


def make_step(model, optimizer, x, y, recipe, mode="eager", clip=None):
    """One training step following `recipe`:

    - "reference": a plain optimizer, the unscaled loss;
    - "keras3": scale_loss, apply the scaled gradients;
    - "tf_keras": get_scaled_loss, get_unscaled_gradients, apply;
    - "keras3_log": as keras3, get_unscaled_gradients only for a norm;
    - "manual": loss * optimizer.loss_scale, get_unscaled_gradients, apply.

    `clip`: clip the gradients to this global norm before applying them
    (after unscaling, in the tf.keras recipe; the reference too).
    """
    variables = model.trainable_variables

    def step():
        with tf.GradientTape() as tape:
            loss = mse(model, x, y)
            if recipe in ("keras3", "keras3_log"):
                loss = optimizer.scale_loss(loss)
            elif recipe == "tf_keras":
                loss = optimizer.get_scaled_loss(loss)
            elif recipe == "manual":
                loss = loss * optimizer.loss_scale
        grads = tape.gradient(loss, variables)
        norm = tf.constant(0.0)
        if recipe == "keras3_log":
            norm = tf.linalg.global_norm(
                optimizer.get_unscaled_gradients(grads)
            )
        elif recipe in ("tf_keras", "manual"):
            grads = optimizer.get_unscaled_gradients(grads)
        if clip is not None:
            grads, _ = tf.clip_by_global_norm(grads, clip)
        optimizer.apply_gradients(zip(grads, variables))
        return norm

    return compile_mode(step, mode)


def nan_like(variable):
    return tf.fill(variable.shape, tf.constant(float("nan"), variable.dtype))
