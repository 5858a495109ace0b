"""Tests for kmp.LowPrecisionOptimizer's state: config, seed and resuming.

On every backend: the config round-trips with the seed in use (a drawn one
too), a `.keras` file reloads the optimizer with its buffers and seed
(untrained too, and saved on another backend), and training resumed from
it is bit-identical to training never stopped; on TensorFlow the same from
a `tf.train.Checkpoint`.
"""

import os
import random

import keras
import numpy as np
import pytest

import kmp
from kmp.core.low_precision import LowPrecisionOptimizer
from tests.support import backends
from tests.support.low_precision import bfloat16_model
from tests.support.low_precision import digits_like
from tests.support.low_precision import logits_loss
from tests.support.low_precision import numpy_of
from tests.support.low_precision import state

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair


def test_config_round_trip():
    if backends.TENSORFLOW:
        inner = kmp.FusedAdam(0.02, beta_1=0.8)
    else:
        inner = keras.optimizers.Adam(0.02, beta_1=0.8)
    optimizer = LowPrecisionOptimizer(
        inner,
        rounding="stochastic",
        slot_dtype="bfloat16",
        seed=42,
        name="low",
    )
    config = optimizer.get_config()
    clone = LowPrecisionOptimizer.from_config(config)
    assert type(clone.inner_optimizer) is type(inner)
    assert clone.get_config() == config
    assert (clone.rounding, clone.slot_dtype, clone.seed) == (
        "stochastic",
        "bfloat16",
        42,
    )
    same = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert same.get_config() == config


def test_a_drawn_seed_is_in_the_config_and_numpy_seeds_are_integers():
    random.seed(3)
    drawn = LowPrecisionOptimizer(keras.optimizers.Adam(), "stochastic")
    assert 0 <= drawn.seed < 2**62
    assert drawn.get_config()["seed"] == drawn.seed
    assert LowPrecisionOptimizer.from_config(drawn.get_config()).seed == (
        drawn.seed
    )
    given = LowPrecisionOptimizer(keras.optimizers.Adam(), seed=np.int64(7))
    assert given.seed == 7 and type(given.get_config()["seed"]) is int
    largest = LowPrecisionOptimizer(keras.optimizers.Adam(), seed=2**63 - 1)
    assert largest.seed == 2**63 - 1


@pytest.mark.tensorflow
@pytest.mark.parametrize(
    "rounding, compiled",
    [("kahan", "plain"), ("stochastic", "plain"), ("stochastic", "compiled")],
    indirect=["compiled"],
)
def test_checkpoint_resumed_run_is_bit_identical(rounding, compiled, tmp_path):
    tf = backends.tensorflow()
    x, y = digits_like()
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 96, 16)]
    loss_fn = logits_loss()

    def fresh():
        model = bfloat16_model()
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(3e-3), rounding, slot_dtype="bfloat16"
        )  # seed=None: drawn, and restored from the checkpoint.
        optimizer.build(model.trainable_variables)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        return model, optimizer, step

    model, optimizer, step = fresh()
    for batch in batches:
        step(*batch)
    uninterrupted = state(model, optimizer)

    model, optimizer, step = fresh()
    for batch in batches[:3]:
        step(*batch)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    path = checkpoint.save(os.path.join(tmp_path, "ckpt"))
    model, optimizer, step = fresh()
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        path
    ).assert_consumed()
    for batch in batches[3:]:
        step(*batch)
    for got, want in zip(state(model, optimizer), uninterrupted):
        np.testing.assert_array_equal(got, want)
    names = {v.path.split("/")[-1] for v in optimizer.variables}
    assert "seed" in names
    assert any("compensation" in n for n in names) == (rounding == "kahan")


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_keras_file_resumed_run_is_bit_identical(rounding, tmp_path):
    x, y = digits_like()

    def fresh():
        model = bfloat16_model()
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(3e-3), rounding, slot_dtype="bfloat16"
        )  # seed=None: drawn, and restored from the file.
        model.compile(optimizer=optimizer, loss=logits_loss())
        return model

    def fit(model, rows):
        model.fit(
            x[rows], y[rows], batch_size=16, shuffle=False, verbose=0
        )  # fmt: skip

    model = fresh()
    fit(model, slice(None))
    uninterrupted = state(model, model.optimizer)

    model = fresh()
    fit(model, slice(0, 48))
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    random.seed(11)  # What a seed drawn anew would come from.
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LowPrecisionOptimizer)
    assert loaded.optimizer.seed == model.optimizer.seed
    fit(loaded, slice(48, None))
    assert int(loaded.optimizer.iterations) == 6
    for got, want in zip(state(loaded, loaded.optimizer), uninterrupted):
        np.testing.assert_array_equal(got, want)


def test_saved_model_reloads_with_its_buffers(tmp_path):
    x, y = digits_like()
    model = bfloat16_model()
    model.compile(
        optimizer=LowPrecisionOptimizer(keras.optimizers.SGD(0.1), seed=3),
        loss=logits_loss(),
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LowPrecisionOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(numpy_of(got), numpy_of(want))


def test_an_untrained_optimizer_keeps_its_drawn_seed_in_a_keras_file(tmp_path):
    # Issue 21: the seed drawn for seed=None was drawn anew on load.
    model = bfloat16_model()
    optimizer = LowPrecisionOptimizer(keras.optimizers.Adam(), "stochastic")
    model.compile(optimizer=optimizer, loss=logits_loss())
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    random.seed(5)  # What a seed drawn anew would come from.
    loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.seed) == int(optimizer.seed)


def test_a_seed_saved_on_another_backend_is_read_as_this_one_keeps_it():
    seed = 2**40 + 7
    saved = LowPrecisionOptimizer(keras.optimizers.SGD(), seed=seed)
    store = {str(i): numpy_of(v) for i, v in enumerate(saved.variables)}
    position = next(
        str(i) for i, v in enumerate(saved.variables) if v is saved._seed
    )
    if store[position].shape == ():  # Saved as JAX keeps it.
        store[position] = np.array([seed >> 32, seed & 0xFFFFFFFF], "uint32")
    else:  # As TensorFlow and torch do.
        store[position] = np.int64(seed)
    loaded = LowPrecisionOptimizer(keras.optimizers.SGD(), seed=1)
    loaded.load_own_variables(store)
    assert loaded.seed == seed
