"""Tests for kmp.core.tensorflow.fused.FusedAdam: Keras's Adam, one fused
kernel.

FusedAdam must follow Keras's Adam to within float rounding wherever it uses
TensorFlow's ResourceApplyAdam kernel, use exactly Keras's update wherever it
cannot (amsgrad, sparse gradients, tf.distribute), and be interchangeable
with Adam in configs, saved models and checkpoints.
"""

import pytest

from tests.support import backends

# TensorFlow only: skipped, before anything imports it, elsewhere.
backends.require("tensorflow")
# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = [pytest.mark.tensorflow, pytest.mark.oldest_pair]

import decimal  # noqa: E402
import fractions  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402

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


# --- Bad input is refused before anything changes -----------------------------


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"learning_rate": "fast"}, TypeError, "learning_rate='fast'"),
        ({"learning_rate": None}, TypeError, "learning_rate=None"),
        ({"learning_rate": True}, TypeError, "learning_rate=True"),
        ({"learning_rate": tf.Variable(0.1)}, TypeError, "a variable"),
        ({"learning_rate": tf.constant(1)}, TypeError, "dtype int32"),
        ({"learning_rate": tf.constant([0.1])}, ValueError, "shape (1,)"),
        ({"learning_rate": -1.0}, ValueError, "learning_rate=-1.0"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate=nan"),
        ({"learning_rate": float("inf")}, ValueError, "learning_rate=inf"),
        ({"learning_rate": 10**400}, ValueError, "finite number >= 0"),
        ({"beta_1": 1.5}, ValueError, "'beta_1' must be a number in [0, 1)"),
        ({"beta_1": 1.0}, ValueError, "Received: beta_1=1.0"),
        ({"beta_1": "0.9"}, TypeError, "beta_1='0.9'"),
        ({"beta_1": True}, TypeError, "beta_1=True"),
        ({"beta_1": lambda: 0.9}, TypeError, "cannot use a callable"),
        ({"beta_1": tf.constant(1.5)}, ValueError, "value 1.5"),
        ({"beta_1": tf.constant(1)}, TypeError, "dtype int32"),
        ({"beta_2": -0.1}, ValueError, "'beta_2' must be a number in [0, 1)"),
        ({"beta_2": float("nan")}, ValueError, "beta_2=nan"),
        ({"beta_2": keras.Variable(2.0)}, ValueError, "value 2.0"),
        ({"epsilon": -1e-7}, ValueError, "'epsilon' must be a finite number"),
        ({"epsilon": float("inf")}, ValueError, "epsilon=inf"),
        ({"epsilon": None}, TypeError, "epsilon=None"),
        ({"amsgrad": "yes"}, TypeError, "'amsgrad' must be True or False"),
        ({"amsgrad": 1}, TypeError, "amsgrad=1"),
        ({"weight_decay": "x"}, TypeError, "weight_decay='x'"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
        ({"weight_decay": float("nan")}, ValueError, "weight_decay=nan"),
        ({"weight_decay": False}, TypeError, "weight_decay=False"),
        # What float32 variables would apply (and Keras's float32 learning
        # rate variable hold): inf, 0, a beta of 1 (1 - beta**t is 0).
        (
            {"learning_rate": 1e39},
            ValueError,
            "learning_rate=1e+39, which overflows float32",
        ),
        (
            {"learning_rate": np.float16(np.inf)},
            ValueError,
            "learning_rate=np.float16(inf)",
        ),
        (
            {"learning_rate": 1e-50},
            ValueError,
            "learning_rate=1e-50, which rounds to 0 in float32",
        ),
        ({"epsilon": 1e39}, ValueError, "epsilon=1e+39, which overflows"),
        (
            {"epsilon": tf.constant(1e39, tf.float64)},
            ValueError,
            "value 1e+39, which overflows float32",
        ),
        (
            {"beta_1": 1 - 1e-9},
            ValueError,
            "beta_1=0.999999999, which rounds to 1.0 in float32",
        ),
        ({"beta_2": np.float16(np.inf)}, ValueError, "np.float16(inf)"),
        ({"weight_decay": 1e39}, ValueError, "weight_decay=1e+39, which"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, error, fragment):
    with pytest.raises(error) as info:
        kmp.FusedAdam(**kwargs)
    assert fragment in str(info.value)
    (name,) = kwargs
    assert f"'{name}'" in str(info.value)


def test_bad_hyperparameters_in_a_config_are_refused():
    config = kmp.FusedAdam(0.01).get_config()
    with pytest.raises(ValueError, match=r"beta_1=1\.5"):
        kmp.FusedAdam.from_config({**config, "beta_1": 1.5})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"learning_rate": np.float32(0.01)},
        {"learning_rate": np.float64(0.01)},
        {"learning_rate": 1},
        {"learning_rate": tf.constant(0.01)},
        {"beta_1": np.float32(0.8), "beta_2": np.float64(0.99)},
        {"beta_1": 0, "epsilon": 0},
        {"epsilon": np.float32(1e-6), "weight_decay": np.int64(0)},
        {"amsgrad": np.bool_(True)},
        {"weight_decay": np.float32(0.01)},
        # Kept as the Python floats Adam keeps, so the config serializes.
        {"learning_rate": fractions.Fraction(1, 100)},
        {
            "beta_1": decimal.Decimal("0.8"),
            "epsilon": fractions.Fraction(1, 10**6),
        },
        {
            "beta_2": ml_dtypes.bfloat16(0.99),
            "weight_decay": np.longdouble(0.01),
        },
    ],
)
def test_numbers_of_any_real_type_are_accepted(kwargs):
    optimizer = kmp.FusedAdam(**kwargs)
    config = optimizer.get_config()
    for name, value in kwargs.items():
        assert config[name] == pytest.approx(float(value), rel=1e-6)
        assert type(config[name]) is (bool if name == "amsgrad" else float)
    json.dumps(config)  # A .keras file holds it as JSON.
    # What it was given is what it runs with: the same as Keras's Adam given
    # the Python floats.
    plain = keras.optimizers.Adam(
        **kmp.FusedAdam.from_config(config).get_config()
    )
    fused = _train(kmp.FusedAdam.from_config(config), "eager")
    adam = _train(plain, "eager")
    for got, want in zip(fused["variables"], adam["variables"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("make", [tf.constant, keras.Variable])
def test_tensor_betas_and_epsilon_are_used_as_adam_uses_them(make, dtype):
    def optimizer(cls):
        return cls(
            0.01, beta_1=make(0.8), beta_2=make(0.99), epsilon=make(1e-3)
        )

    fused = _train(optimizer(kmp.FusedAdam), "tf_function", dtype)
    plain = _train(optimizer(keras.optimizers.Adam), "tf_function", dtype)
    assert "ResourceApplyAdam" in fused["graph_ops"]
    tolerance = {"float16": 5e-3, "float64": 1e-5}[dtype]
    for got, want in zip(fused["variables"], plain["variables"]):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def _state(optimizer, variables):
    return [v.numpy().copy() for v in variables] + (
        [v.numpy().copy() for v in optimizer.variables]
        if optimizer.built
        else []
    )


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("built", [False, True])
@pytest.mark.parametrize(
    "bad, received",
    [
        (lambda: tf.ones((3, 3)), "a tensor of dtype float32 and shape (3, 3)"),
        # Keras's Adam would broadcast this one over the variable.
        (lambda: tf.ones((2, 1)), "and shape (2, 1)"),
        (
            lambda: np.ones((2, 2, 1), "float32"),
            "and shape (2, 2, 1)",
        ),
        (
            lambda: tf.IndexedSlices(
                tf.ones((1, 3)), tf.constant([0]), tf.constant([2, 3])
            ),
            "values of shape (1, 3)",
        ),
    ],
)
def test_gradient_of_the_wrong_shape_is_refused_before_any_update(
    mode, built, bad, received
):
    # The bad gradient comes second: eagerly, Keras updates variable by
    # variable, so the first must not have been updated either.
    first = keras.Variable(np.ones((3,), "float32"), name="first")
    second = keras.Variable(np.ones((2, 2), "float32"), name="second")
    variables = [first, second]
    optimizer = kmp.FusedAdam(0.1)
    if built:
        optimizer.apply_gradients(zip([tf.ones(3), tf.ones((2, 2))], variables))
    before = _state(optimizer, variables)
    iterations = int(optimizer.iterations)

    def step():
        optimizer.apply([tf.ones(3), bad()], variables)

    if mode == "tf_function":
        step = tf.function(step)
    with pytest.raises(ValueError) as info:
        step()
    message = str(info.value)
    assert f"'{second.path}' (position 1)" in message
    assert "its variable's shape (2, 2)" in message
    assert received in message
    assert optimizer.built == built
    assert int(optimizer.iterations) == iterations
    for got, want in zip(_state(optimizer, variables), before):
        np.testing.assert_array_equal(got, want)


def test_gradients_without_variables_are_checked_against_the_built_ones():
    variable = keras.Variable(np.ones((2, 2), "float32"), name="w")
    optimizer = kmp.FusedAdam(0.1)
    optimizer.build([variable])
    with pytest.raises(
        ValueError,
        match=r"'w' \(position 0\) must have its variable's shape \(2, 2\)",
    ):
        optimizer.apply([tf.ones((2, 1))])
    assert int(optimizer.iterations) == 0
    np.testing.assert_array_equal(variable.numpy(), np.ones((2, 2)))


def test_as_many_gradients_as_variables_are_required():
    variables = [keras.Variable(np.ones(2, "float32")) for _ in range(2)]
    optimizer = kmp.FusedAdam(0.1)
    with pytest.raises(ValueError, match="2 gradients for 1 variables"):
        optimizer.apply([tf.ones(2), tf.ones(2)], variables[:1])
    with pytest.raises(ValueError, match="1 gradients for 2 variables"):
        optimizer.apply([tf.ones(2)], variables)
    assert not optimizer.built


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
def test_gradients_of_compatible_shapes_are_applied():
    # Unknown dimensions in a tf.function, None gradients and sparse rows
    # pass the check.
    dense = keras.Variable(np.ones((4, 2), "float32"))
    table = keras.Variable(np.ones((5, 3), "float32"))
    unused = keras.Variable(np.ones(2, "float32"))
    optimizer = kmp.FusedAdam(0.1)
    optimizer.build([dense, table, unused])

    @tf.function(input_signature=[tf.TensorSpec([None, 2])])
    def step(gradient):
        rows = tf.IndexedSlices(
            tf.ones((2, 3)), tf.constant([0, 3]), tf.constant([5, 3])
        )
        optimizer.apply([gradient, rows, None], [dense, table, unused])

    step(tf.ones((4, 2)))
    assert int(optimizer.iterations) == 1
    assert not np.allclose(dense.numpy(), 1.0)
    assert not np.allclose(table.numpy()[[0, 3]], 1.0)
    np.testing.assert_array_equal(table.numpy()[[1, 2, 4]], 1.0)


def test_integer_gradient_is_refused_before_any_update():
    variable = keras.Variable(np.ones((2,), "float32"), name="w")
    optimizer = kmp.FusedAdam(0.1)
    with pytest.raises(TypeError, match=r"'w' \(position 0\) must be floating"):
        optimizer.apply([tf.ones((2,), "int32")], [variable])
    assert not optimizer.built
    np.testing.assert_array_equal(variable.numpy(), np.ones(2))
