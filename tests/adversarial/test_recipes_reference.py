"""Every recipe, mixed every way, against a float32 reference bit for bit.

With a float32 model and a power-of-two scale, the gradients of the scaled
loss are the true gradients times the scale exactly, so any recipe that
unscales once and applies once gives the plain optimizer's update to the
last bit (docs/guarantees.md: "train exactly like the float32 reference,
bit for bit").
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.adversarial._support import LSO
from tests.adversarial._support import MODES
from tests.adversarial._support import assert_bits_equal
from tests.adversarial._support import compile_mode
from tests.adversarial._support import data
from tests.adversarial._support import dense_model
from tests.adversarial._support import make_step
from tests.adversarial._support import mse
from tests.adversarial._support import scale_of
from tests.adversarial._support import values

X = data((8, 3), 1)
Y = data((8, 2), 2)
STEPS = 2
RECIPES = ["keras3", "tf_keras", "keras3_log", "manual"]
INNERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.5),
    "adam": lambda: keras.optimizers.Adam(0.01),
}

_references = {}


def reference(inner, mode, clip=None):
    """The plain optimizer's model variables after STEPS steps (cached)."""
    key = (inner, mode, clip)
    if key not in _references:
        model = dense_model()
        step = make_step(
            model, INNERS[inner](), X, Y, "reference", mode, clip=clip
        )
        for _ in range(STEPS):
            step()
        _references[key] = values(model)
    return _references[key]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_every_recipe_matches_float32_reference(inner, mode):
    """Four models, one per recipe, stepped in one function (one trace)."""
    models = {recipe: dense_model() for recipe in RECIPES}
    optimizers = {
        recipe: LSO(INNERS[inner](), dynamic_growth_steps=1)
        for recipe in RECIPES
    }
    steps = [make_step(models[r], optimizers[r], X, Y, r) for r in RECIPES]

    def all_steps():
        for step in steps:
            step()

    all_steps = compile_mode(all_steps, mode)
    for _ in range(STEPS):
        all_steps()
    for recipe in RECIPES:
        assert_bits_equal(
            values(models[recipe]), reference(inner, mode), recipe
        )
        # The scale grew every step (it changes nothing in the result).
        assert scale_of(optimizers[recipe]) == 2.0 ** (15 + STEPS), recipe


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_transform_between_unscale_and_apply(mode):
    model = dense_model()
    optimizer = LSO(INNERS["adam"]())
    step = make_step(model, optimizer, X, Y, "tf_keras", mode, clip=0.1)
    for _ in range(STEPS):
        step()
    assert_bits_equal(values(model), reference("adam", mode, clip=0.1))


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_recipes_switched_from_step_to_step(mode):
    """One optimizer, a different recipe at every step."""
    model = dense_model()
    optimizer = LSO(INNERS["adam"]())
    sequence = ["keras3", "tf_keras", "keras3_log", "manual", "keras3"]
    for recipe in sequence:
        make_step(model, optimizer, X, Y, recipe, mode)()
    plain = dense_model()
    plain_step = make_step(plain, INNERS["adam"](), X, Y, "reference", mode)
    for _ in sequence:
        plain_step()
    assert_bits_equal(values(model), values(plain))


def test_fit_matches_float32_fit():
    results = []
    for wrap in (False, True):
        model = dense_model()
        optimizer = INNERS["adam"]()
        model.compile(
            optimizer=LSO(optimizer) if wrap else optimizer, loss="mse"
        )
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        results.append(values(model))
    assert_bits_equal(results[1], results[0])


def test_fit_then_custom_loop_then_fit():
    """fit (Keras 3 recipe) and a tf.keras loop on one optimizer."""
    results = []
    for wrap in (False, True):
        model = dense_model()
        inner = INNERS["sgd"]()
        optimizer = LSO(inner) if wrap else inner
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        recipe = "tf_keras" if wrap else "reference"
        make_step(model, optimizer, X, Y, recipe, "tf_function")()
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results.append(values(model))
    assert_bits_equal(results[1], results[0])


def test_unscaled_by_another_optimizer_only_to_log():
    """get_unscaled_gradients of a second optimizer (a mistake, harmless):
    the first optimizer still unscales its Keras 3 recipe's gradients."""
    model = dense_model()
    optimizer = LSO(INNERS["sgd"]())
    other = LSO(keras.optimizers.SGD(), initial_scale=4)
    with tf.GradientTape() as tape:
        loss = optimizer.scale_loss(mse(model, X, Y))
    grads = tape.gradient(loss, model.trainable_variables)
    other.get_unscaled_gradients(grads)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    plain = dense_model()
    make_step(plain, INNERS["sgd"](), X, Y, "reference")()
    assert_bits_equal(values(model), values(plain))


def test_ambiguous_mix_after_scale_loss_is_refused():
    """After scale_loss and get_unscaled_gradients, transformed gradients
    cannot be told scaled or not: refused, nothing changed."""
    model = dense_model()
    optimizer = LSO(INNERS["adam"]())
    optimizer.build(model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = optimizer.scale_loss(mse(model, X, Y))
    grads = tape.gradient(loss, model.trainable_variables)
    unscaled = optimizer.get_unscaled_gradients(grads)
    clipped, _ = tf.clip_by_global_norm(unscaled, 1.0)
    before = values(model, optimizer)
    with pytest.raises(ValueError, match="scaled"):
        optimizer.apply_gradients(zip(clipped, model.trainable_variables))
    assert_bits_equal(values(model, optimizer), before)


def test_failed_scale_call_keeps_the_recipe():
    """A get_scaled_loss refused after scale_loss does not switch the
    recipe: the scaled gradients are still unscaled once."""
    model = dense_model()
    optimizer = LSO(INNERS["sgd"]())
    with tf.GradientTape() as tape:
        loss = optimizer.scale_loss(mse(model, X, Y))
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(TypeError):
        optimizer.get_scaled_loss("not a loss")
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    plain = dense_model()
    make_step(plain, INNERS["sgd"](), X, Y, "reference")()
    assert_bits_equal(values(model), values(plain))


def test_gradients_computed_in_one_function_applied_in_another():
    """scale_loss in one tf.function, apply_gradients in another."""
    model = dense_model()
    optimizer = LSO(INNERS["adam"]())
    variables = model.trainable_variables

    @tf.function
    def compute():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(mse(model, X, Y))
        return tape.gradient(loss, variables)

    @tf.function
    def apply(grads):
        optimizer.apply_gradients(zip(grads, variables))

    for _ in range(STEPS):
        apply(compute())
    assert_bits_equal(values(model), reference("adam", "tf_function"))


def test_gradients_computed_in_one_thread_applied_in_another():
    model = dense_model()
    optimizer = LSO(INNERS["sgd"]())
    variables = model.trainable_variables
    out = {}

    def compute():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(mse(model, X, Y))
        out["grads"] = tape.gradient(loss, variables)

    worker = threading.Thread(target=compute)
    worker.start()
    worker.join()
    optimizer.apply_gradients(zip(out["grads"], variables))
    plain = dense_model()
    make_step(plain, INNERS["sgd"](), X, Y, "reference")()
    assert_bits_equal(values(model), values(plain))


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_nan_loss_skips_every_recipe(mode):
    for recipe in RECIPES:
        model = dense_model()
        optimizer = LSO(INNERS["adam"]())
        optimizer.build(model.trainable_variables)
        before = values(model)
        make_step(model, optimizer, X, Y * np.nan, recipe, mode)()
        assert_bits_equal(values(model), before, recipe)
        assert int(optimizer.iterations) == 0, recipe
        assert scale_of(optimizer) == 2.0**14, recipe
