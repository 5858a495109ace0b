"""Tests for kmp.core.loss_scale.recipes: which loss-scaling recipe a step
follows.

The recipe is decided per optimizer from what was called on it:
`scale_loss` (Keras 3's recipe, and `fit`) means `apply_gradients` gets the
still-scaled gradients and unscales them; `get_scaled_loss` (tf.keras's)
means it gets gradients unscaled by `get_unscaled_gradients`, possibly
transformed. Either way the result is the float32 reference, bit for bit.
"""

import re

import keras
import numpy as np
import pytest

from kmp import LossScaleOptimizer
from tests.support import backends
from tests.support import training
from tests.support.training import BATCH_SIZE
from tests.support.training import MODES
from tests.support.training import OPTIMIZERS
from tests.support.training import X
from tests.support.training import Y


@pytest.mark.parametrize("mode", MODES)
def test_keras_style_loop_matches_the_float32_reference(mode):
    # scale_loss -> tape.gradient -> apply_gradients with scaled gradients.
    # SGD, whose update is proportional to the gradient, shows any scale left.
    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"]())
    weights = training.loop_weights(optimizer, mode, "keras")
    training.assert_weights_equal(
        weights, training.reference_weights("sgd", mode)
    )


@pytest.mark.tensorflow
def test_keras_style_gradients_from_a_separate_tf_function():
    # scale_loss is traced once; apply_gradients runs eagerly every step and
    # must unscale every step, not only after the call that traced.
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.125), initial_scale=1024
    )
    tf = backends.tensorflow()

    @tf.function
    def scaled_gradients():
        with tf.GradientTape() as tape:
            scaled_loss = optimizer.scale_loss(tf.reduce_sum(variable))
        return tape.gradient(scaled_loss, [variable])

    values = []
    for _ in range(3):
        optimizer.apply_gradients(zip(scaled_gradients(), [variable]))
        values.append(float(variable[0]))
    assert values == [0.875, 0.75, 0.625]


@pytest.mark.parametrize("mode", MODES)
def test_gradients_may_be_clipped_between_unscaling_and_applying(mode):
    def clip(grads):
        return backends.global_norm_clip(grads, 0.05)

    expected = training.loop_weights(OPTIMIZERS["sgd"](), mode, "plain", clip)
    # The clipping binds, so clipping scaled gradients would differ.
    unclipped = training.reference_weights("sgd", mode)
    assert any(not np.array_equal(a, b) for a, b in zip(expected, unclipped))

    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"]())
    weights = training.loop_weights(optimizer, mode, "contract", clip)
    training.assert_weights_equal(weights, expected)


# --- Per optimizer ------------------------------------------------------------


@pytest.mark.parametrize("mode", backends.STATEFUL_MODES)
def test_two_optimizers_in_one_step_follow_their_own_recipes(mode):
    # Changed on purpose: the recipe used to be one record per graph, so the
    # last scale call of any optimizer decided for all of them (a GAN's two
    # optimizers in one step got each other's recipe).
    keras_recipe = LossScaleOptimizer(OPTIMIZERS["sgd"](), initial_scale=64)
    tf_keras_recipe = LossScaleOptimizer(OPTIMIZERS["sgd"](), initial_scale=8)
    first, second = training.model(), training.model()
    loss_fn = keras.losses.MeanSquaredError()

    def step(x, y):
        # Both scale calls come before either optimizer applies.
        first_grads = backends.gradients(
            lambda: keras_recipe.scale_loss(loss_fn(y, first(x))),
            first.trainable_variables,
        )
        second_grads = backends.gradients(
            lambda: tf_keras_recipe.get_scaled_loss(loss_fn(y, second(x))),
            second.trainable_variables,
        )
        second_grads = tf_keras_recipe.get_unscaled_gradients(second_grads)
        keras_recipe.apply_gradients(
            zip(first_grads, first.trainable_variables)
        )
        tf_keras_recipe.apply_gradients(
            zip(second_grads, second.trainable_variables)
        )

    step = training.compiled(step, mode)
    for start in range(0, len(X), BATCH_SIZE):
        batch = slice(start, start + BATCH_SIZE)
        step(backends.tensor(X[batch]), backends.tensor(Y[batch]))
    reference = training.reference_weights("sgd", mode)
    training.assert_weights_equal(first.get_weights(), reference)
    training.assert_weights_equal(second.get_weights(), reference)


@pytest.mark.parametrize("mode", MODES)
def test_unscaled_gradients_may_be_inspected_in_the_keras_recipe(mode):
    # scale_loss, then get_unscaled_gradients only to look (a norm for a
    # log): the scaled gradients still go to apply_gradients, which unscales
    # them once.
    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"]())
    norms = []

    def inspect(grads):
        unscaled = training.unscale(optimizer, grads)
        norms.append(
            keras.ops.sqrt(sum(keras.ops.sum(g * g) for g in unscaled))
        )
        return grads

    weights = training.loop_weights(optimizer, mode, "keras", inspect)
    training.assert_weights_equal(
        weights, training.reference_weights("sgd", mode)
    )
    assert norms


@pytest.mark.parametrize("mode", MODES)
def test_keras_recipe_may_apply_what_get_unscaled_gradients_returned(mode):
    # The usual `grads = optimizer.get_unscaled_gradients(grads)`: the
    # scaled gradients are dropped before apply_gradients.
    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"]())
    weights = training.loop_weights(
        optimizer,
        mode,
        "keras",
        lambda grads: training.unscale(optimizer, grads),
    )
    training.assert_weights_equal(
        weights, training.reference_weights("sgd", mode)
    )


@pytest.mark.parametrize("mode", MODES)
def test_transformed_gradients_after_both_calls_are_refused(mode):
    # After scale_loss and get_unscaled_gradients, clipped gradients are
    # neither the scaled ones nor the unscaled ones: ambiguous.
    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"](), initial_scale=8)

    def clip(grads):
        unscaled = training.unscale(optimizer, grads)
        return backends.global_norm_clip(unscaled, 0.05)

    with pytest.raises(ValueError, match="Cannot tell whether the gradients"):
        training.loop_weights(optimizer, mode, "keras", clip)
    assert training.optimizer_state(optimizer) == (8.0, 0, 0, 0)


@pytest.mark.jax
@pytest.mark.torch
def test_transformed_gradients_to_stateless_apply_name_scaled_false():
    # The JAX loop: stateless_scale_loss, stateless_unscale_gradients, a
    # transform; stateless_apply must be told the gradients are unscaled.
    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"](), initial_scale=8)
    weight = keras.Variable([1.0])
    optimizer.build([weight])
    values = [v.value for v in optimizer.variables]
    optimizer.stateless_scale_loss(values, backends.tensor(1.0))
    grads = optimizer.stateless_unscale_gradients(
        values, [backends.tensor([8.0])]
    )
    clipped = [g * 0.5 for g in grads]
    call = (
        "optimizer.stateless_apply(optimizer_variables, grads, "
        "trainable_variables, scaled=False)"
    )
    with pytest.raises(ValueError, match=re.escape(call)):
        optimizer.stateless_apply(values, clipped, [weight.value])
    new_weights, _ = optimizer.stateless_apply(
        values, clipped, [weight.value], scaled=False
    )
    assert keras.ops.convert_to_numpy(new_weights[0])[0] == np.float32(0.95)
