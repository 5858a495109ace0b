"""Inner optimizers of every kind, inner options, wrappers and two
optimizers: skipped steps leave everything exactly as it was, finite steps
give the inner optimizer's own result bit for bit.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from tests.adversarial._support import LSO
from tests.adversarial._support import assert_bits_equal
from tests.adversarial._support import data
from tests.adversarial._support import dense_model
from tests.adversarial._support import make_step
from tests.adversarial._support import mse
from tests.adversarial._support import values

optimizers = keras.optimizers


def multi():
    """Biases by Adam, kernels by SGD (chosen by shape: layer names differ
    from model to model)."""
    sgd, adam = optimizers.SGD(0.05, momentum=0.9), optimizers.Adam(0.01)
    return optimizers.MultiOptimizer(
        lambda v: adam if len(v.shape) == 1 else sgd
    )


INNERS = {
    "sgd_momentum": lambda: optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: optimizers.Adam(0.01),
    "adam_amsgrad": lambda: optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: optimizers.AdamW(0.01, weight_decay=0.1),
    "adamax": lambda: optimizers.Adamax(0.01),
    "adagrad": lambda: optimizers.Adagrad(0.05),
    "adadelta": lambda: optimizers.Adadelta(1.0),
    "adafactor": lambda: optimizers.Adafactor(0.01),
    "ftrl": lambda: optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
    "lamb": lambda: optimizers.Lamb(0.01),
    "lion": lambda: optimizers.Lion(0.001),
    "nadam": lambda: optimizers.Nadam(0.01),
    "rmsprop": lambda: optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adam_ema": lambda: optimizers.Adam(
        0.01, use_ema=True, ema_overwrite_frequency=2
    ),
    "adam_accumulate": lambda: optimizers.Adam(
        0.01, gradient_accumulation_steps=2
    ),
    "sgd_clipnorm": lambda: optimizers.SGD(0.05, clipnorm=0.1),
    "adam_global_clipnorm": lambda: optimizers.Adam(0.01, global_clipnorm=0.1),
    "sgd_clipvalue": lambda: optimizers.SGD(0.05, clipvalue=0.01),
    "fused_adam": lambda: kmp.FusedAdam(0.01),
    "low_precision": lambda: kmp.LowPrecisionOptimizer(
        optimizers.Adam(0.01), seed=1
    ),
    "multi_optimizer": multi,
}
X = data((8, 3), 1)
Y = data((8, 2), 2)
Y_NAN = tf.fill((8, 2), float("nan"))
# kmp's steps: finite, non-finite (skipped), finite, finite; the plain
# optimizer's: the three finite ones.
PATTERN = [Y, Y_NAN, Y, Y]


def constrained_model():
    model = dense_model()
    model.layers[0].kernel.constraint = keras.constraints.MaxNorm(1.0)
    return model


# The graph path for the optimizers whose state is not only slots: EMA,
# accumulators, weight decay, clipping, and kmp's and Keras's wrappers (one
# tf.function per configuration: a graph holding all of them takes minutes
# to optimize).
IN_GRAPHS = [
    "adam",
    "adamw",
    "adam_ema",
    "adam_accumulate",
    "adam_global_clipnorm",
    "fused_adam",
    "low_precision",
    "multi_optimizer",
]


def train(name, wrapped, mode):
    model = constrained_model()
    inner = INNERS[name]()
    optimizer = LSO(inner) if wrapped else inner
    variables = model.trainable_variables

    def step(y):
        with tf.GradientTape() as tape:
            loss = mse(model, X, y)
            if wrapped:
                loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))

    if mode == "tf_function":
        step = tf.function(step)
    for y in PATTERN:
        if wrapped or y is not Y_NAN:
            step(y)
    return model, inner, optimizer


@pytest.mark.parametrize(
    "mode, name",
    [("eager", name) for name in INNERS]
    + [("tf_function", name) for name in IN_GRAPHS],
)
def test_inner_optimizer_skips_exactly(name, mode):
    model, inner, optimizer = train(name, True, mode)
    plain_model, plain_inner, plain = train(name, False, mode)
    assert_bits_equal(values(model), values(plain_model), "model variable")
    assert_bits_equal(
        values(inner), values(plain_inner), "inner optimizer variable"
    )
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == int(plain.iterations)


def test_loss_scale_optimizer_inside_low_precision_refused():
    with pytest.raises(TypeError, match="LossScaleOptimizer"):
        kmp.LowPrecisionOptimizer(LSO(optimizers.SGD()))


def test_low_precision_float16_variables_skip_exactly():
    """float16 weights (LowPrecisionOptimizer inside LossScaleOptimizer, as
    documented): a skipped step keeps weights and compensation buffers."""
    kmp.set_global_policy("float16")
    model = dense_model()
    inner = kmp.LowPrecisionOptimizer(optimizers.Adam(0.01), seed=1)
    optimizer = LSO(inner)
    step = tf.function(
        lambda y: make_step(model, optimizer, X, y, "tf_keras")()
    )
    step(Y)
    before = values(model, inner)
    step(Y_NAN)
    assert_bits_equal(values(model, inner), before)
    step(Y)
    assert all(np.all(np.isfinite(v)) for v in values(model))
    assert int(optimizer.iterations) == 2


def test_loss_scale_optimizer_inside_a_multi_optimizer_refused():
    """Keras refuses it (when the MultiOptimizer is built), before any
    variable changes."""
    model = dense_model()
    optimizer = optimizers.MultiOptimizer(
        optimizers.OptimizerMap(default_optimizer=LSO(optimizers.Adam(0.01)))
    )
    before = values(model)
    with pytest.raises(ValueError, match="MultiOptimizer"):
        make_step(model, optimizer, X, Y, "reference")()
    assert_bits_equal(values(model), before)


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize(
    "recipes",
    [
        ("keras3", "keras3"),
        ("tf_keras", "tf_keras"),
        ("tf_keras", "keras3_log"),
    ],
)
def test_two_optimizers_in_one_step(recipes, mode):
    def run(wrap):
        models = [dense_model(seed=1), dense_model(seed=2)]
        pair = [
            LSO(optimizers.Adam(0.01)) if wrap else optimizers.Adam(0.01)
            for _ in models
        ]
        steps = [
            make_step(m, o, X, Y, r if wrap else "reference")
            for m, o, r in zip(models, pair, recipes)
        ]

        def both():
            for step in steps:
                step()

        both = both if mode == "eager" else tf.function(both)
        both()
        both()
        return values(models)

    assert_bits_equal(run(True), run(False))


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_two_applies_after_one_scale_loss(mode):
    """One scaled loss of two models, one optimizer applying twice."""

    def run(wrap):
        first, second = dense_model(seed=1), dense_model(seed=2)
        optimizer = LSO(optimizers.SGD(0.05)) if wrap else optimizers.SGD(0.05)
        optimizer.build(first.trainable_variables + second.trainable_variables)

        def step():
            with tf.GradientTape() as tape:
                loss = mse(first, X, Y) + mse(second, X, Y)
                if wrap:
                    loss = optimizer.scale_loss(loss)
            grads = tape.gradient(
                loss, first.trainable_variables + second.trainable_variables
            )
            n = len(first.trainable_variables)
            optimizer.apply_gradients(zip(grads[:n], first.trainable_variables))
            optimizer.apply_gradients(
                zip(grads[n:], second.trainable_variables)
            )

        step = step if mode == "eager" else tf.function(step)
        step()
        return values(first, second) + [int(optimizer.iterations)]

    assert_bits_equal(run(True), run(False))


def test_compile_keeps_a_given_keras_loss_scale_optimizer():
    kmp.set_global_policy("mixed_float16")
    model = dense_model()
    optimizer = optimizers.LossScaleOptimizer(optimizers.SGD())
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer
    ours = LSO(optimizers.SGD())
    model.compile(optimizer=ours, loss="mse")
    assert model.optimizer is ours
    model.compile(optimizer="adam", loss="mse")
    assert isinstance(model.optimizer, LSO)
    assert model.optimizer.dynamic
