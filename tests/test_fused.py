"""Tests for kmp.FusedAdam: Keras's Adam, updated by one fused kernel.

FusedAdam must follow Keras's Adam to within float rounding wherever it uses
TensorFlow's ResourceApplyAdam kernel, use exactly Keras's update wherever it
cannot (amsgrad, sparse gradients, tf.distribute), and be interchangeable
with Adam in configs, saved models and checkpoints.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

MODES = ["eager", "tf_function", "jit"]
_RNG = np.random.default_rng(0)
SHAPES = [(7, 5), (5,)]
INITIAL = [_RNG.normal(size=shape).astype("float32") for shape in SHAPES]
# Magnitudes from 1e-6 to 1e2, so both small and large updates are compared.
GRADIENTS = [
    [
        (_RNG.normal(size=shape) * 10 ** _RNG.uniform(-6, 2)).astype("float32")
        for shape in SHAPES
    ]
    for _ in range(8)
]


def _train(optimizer, mode, dtype="float32", gradients=GRADIENTS):
    """Applies `gradients` step by step; returns variables and moments."""
    variables = [keras.Variable(value, dtype=dtype) for value in INITIAL]
    optimizer.build(variables)

    def step(grads):
        optimizer.apply_gradients(zip(grads, variables))

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "jit")
    for grads in gradients:
        step([tf.constant(g, dtype=dtype) for g in grads])
    return {
        "variables": [v.numpy().astype("float64") for v in variables],
        "optimizer": [v.numpy().astype("float64") for v in optimizer.variables],
        "graph_ops": _op_types(step, gradients[0], dtype)
        if mode != "eager"
        else None,
    }


def _op_types(step, grads, dtype):
    graph = step.get_concrete_function(
        [tf.TensorSpec(np.shape(g), dtype) for g in grads]
    ).graph
    return {op.type for op in graph.get_operations()}


# --- The fused update is Adam's -----------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_fused_adam_follows_keras_adam(mode):
    fused = _train(kmp.FusedAdam(0.01), mode)
    plain = _train(keras.optimizers.Adam(0.01), mode)
    if mode != "eager":
        assert "ResourceApplyAdam" in fused["graph_ops"]
        assert "ResourceApplyAdam" not in plain["graph_ops"]
    for got, want in zip(
        fused["variables"] + fused["optimizer"],
        plain["variables"] + plain["optimizer"],
    ):
        # Rounding, not a different update: 1 - beta_2 in float32 alone is
        # 1.3e-5 away from Keras's float64 constant, relatively.
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    assert not np.allclose(fused["variables"][0], INITIAL[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_fused_adam_updates_variables_of_any_float_dtype(dtype):
    fused = _train(kmp.FusedAdam(0.01), "tf_function", dtype)
    plain = _train(keras.optimizers.Adam(0.01), "tf_function", dtype)
    assert "ResourceApplyAdam" in fused["graph_ops"]
    # Keras rounds some of its constants through float32 even for float64
    # variables; the fused kernel does not.
    tolerance = {"float16": 5e-3, "bfloat16": 3e-2, "float64": 1e-4}[dtype]
    for got, want in zip(fused["variables"], plain["variables"]):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def test_fused_adam_follows_a_learning_rate_schedule():
    def schedule():
        return keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)

    fused = _train(kmp.FusedAdam(schedule()), "tf_function")
    plain = _train(keras.optimizers.Adam(schedule()), "tf_function")
    constant = _train(kmp.FusedAdam(0.1), "tf_function")
    np.testing.assert_allclose(
        fused["variables"][0], plain["variables"][0], rtol=1e-4, atol=1e-5
    )
    assert not np.allclose(fused["variables"][0], constant["variables"][0])


# --- Where Keras's own update runs --------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_amsgrad_uses_keras_update_exactly(mode):
    fused = _train(kmp.FusedAdam(0.01, amsgrad=True), mode)
    plain = _train(keras.optimizers.Adam(0.01, amsgrad=True), mode)
    if mode != "eager":
        assert "ResourceApplyAdam" not in fused["graph_ops"]
    for got, want in zip(
        fused["variables"] + fused["optimizer"],
        plain["variables"] + plain["optimizer"],
    ):
        np.testing.assert_array_equal(got, want)


def test_sparse_gradients_use_keras_update_exactly():
    def train(optimizer):
        keras.utils.set_random_seed(0)
        layer = keras.layers.Embedding(10, 3)
        layer.build((None,))
        ids = tf.constant([1, 4, 4, 7])

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids) ** 2)
            grads = tape.gradient(loss, layer.trainable_variables)
            assert isinstance(grads[0], tf.IndexedSlices)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))

        for _ in range(3):
            step()
        return layer.embeddings.numpy()

    np.testing.assert_array_equal(
        train(kmp.FusedAdam(0.1)), train(keras.optimizers.Adam(0.1))
    )


def test_distributed_training_uses_keras_update_exactly(two_replicas):
    x = tf.constant(_RNG.normal(size=(8, 4)).astype("float32"))
    y = tf.constant(_RNG.normal(size=(8, 2)).astype("float32"))

    def train(make_optimizer):
        keras.utils.set_random_seed(0)
        with two_replicas.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            optimizer = make_optimizer()
            optimizer.build(model.trainable_variables)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step():
            two_replicas.run(replica_step, args=(x, y))

        for _ in range(3):
            step()
        return [v.numpy() for v in model.trainable_variables]

    fused = train(lambda: kmp.FusedAdam(0.01))
    plain = train(lambda: keras.optimizers.Adam(0.01))
    for got, want in zip(fused, plain):
        np.testing.assert_array_equal(got, want)


# --- Interchangeable with Adam ------------------------------------------------


def test_config_round_trip_and_same_variables_as_adam():
    optimizer = kmp.FusedAdam(0.02, beta_1=0.8, epsilon=1e-6, clipnorm=1.0)
    config = optimizer.get_config()
    assert config == {
        **keras.optimizers.Adam(
            0.02, beta_1=0.8, epsilon=1e-6, clipnorm=1.0
        ).get_config(),
        "name": config["name"],
    }
    clone = kmp.FusedAdam.from_config(config)
    assert isinstance(clone, kmp.FusedAdam)
    assert clone.get_config() == config
    variables = [keras.Variable(value) for value in INITIAL]
    adam = keras.optimizers.Adam()
    adam.build(variables)
    optimizer.build(variables)
    assert [v.shape for v in optimizer.variables] == [
        v.shape for v in adam.variables
    ]


def test_saved_model_reloads_with_fused_adam_and_its_state(tmp_path):
    kmp.set_global_policy("mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(2, dtype="float32"),
        ]
    )
    model.compile(optimizer=kmp.FusedAdam(0.01), loss="mse")
    x = _RNG.normal(size=(32, 4)).astype("float32")
    y = _RNG.normal(size=(32, 2)).astype("float32")
    history = model.fit(x, y, epochs=5, batch_size=8, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, kmp.FusedAdam)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_adam_checkpoint_restores_into_fused_adam(tmp_path):
    variables = [keras.Variable(value) for value in INITIAL]
    adam = keras.optimizers.Adam(0.01)
    adam.build(variables)
    adam.apply_gradients(zip([tf.constant(g) for g in GRADIENTS[0]], variables))
    prefix = tf.train.Checkpoint(optimizer=adam).save(
        os.path.join(tmp_path, "ckpt")
    )
    fused = kmp.FusedAdam(0.01)
    fused.build([keras.Variable(value) for value in INITIAL])
    tf.train.Checkpoint(optimizer=fused).restore(prefix).assert_consumed()
    for got, want in zip(fused.variables, adam.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
