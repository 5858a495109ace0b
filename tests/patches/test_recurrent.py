"""Tests for the `recurrent` patch: weights cast once per call, not per step.

Every comparison runs the same layer (same seed, same weights) with Keras's
own time loop and with the patch installed, and asserts that outputs
and gradients are bit-identical.
"""

import pytest

from tests.support import backends

# TensorFlow only: skipped, before anything imports it, elsewhere.
backends.require("tensorflow")
# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = [pytest.mark.tensorflow, pytest.mark.oldest_pair]

import collections  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras.src.layers.rnn import rnn as keras_rnn  # noqa: E402

import kmp  # noqa: E402
from kmp.patches import recurrent  # noqa: E402

LAYERS = {
    "lstm": keras.layers.LSTM,
    "gru": keras.layers.GRU,
    "simple_rnn": keras.layers.SimpleRNN,
}
OPTIONS = {
    "last_output": {},
    "return_sequences": {"return_sequences": True},
    "go_backwards": {"go_backwards": True},
    "masked": {"masked": True},
    "stateful": {"stateful": True},
    "unroll": {"unroll": True},
    "return_state": {"return_state": True},
}
MODES = ["eager", "tf_function"]


def _is_installed():
    return "recurrent" in kmp.patches.installed()


def _inputs():
    x = np.random.default_rng(0).standard_normal((3, 5, 4))
    x[1, 3:] = 0.0  # Padding, for the masked runs.
    return tf.constant(x.astype("float32"))


def _set_installed(installed, exact=True):
    # The autouse fixture in conftest.py puts the patch and its setting back.
    if installed:
        kmp.patches.install("recurrent")
        recurrent.set_exact(exact)
    else:
        kmp.patches.uninstall("recurrent")


def _run(layer_name, installed, mode="tf_function", exact=True, **options):
    """Builds a seeded layer and returns its outputs and gradients (NumPy).

    Runs two steps, so a stateful layer also starts from a carried state.
    """
    options = dict(options)
    masked = options.pop("masked", False)
    keras.utils.set_random_seed(1)
    layer = LAYERS[layer_name](8, **options)
    inputs = _inputs()
    layer.build(inputs.shape)
    _set_installed(installed, exact)

    def step(inputs):
        mask = tf.reduce_any(inputs != 0.0, axis=-1) if masked else None
        with tf.GradientTape() as tape:
            outputs = tf.nest.flatten(layer(inputs, mask=mask))
            loss = tf.add_n(
                [tf.reduce_sum(tf.cast(y, "float32") ** 2) for y in outputs]
            )
        return outputs, tape.gradient(loss, layer.trainable_variables)

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "jit")
    results = []
    for _ in range(2):
        outputs, gradients = step(inputs)
        results += [t.numpy() for t in outputs + gradients]
    return results


def _assert_identical(expected, actual):
    assert len(expected) == len(actual)
    for index, (a, b) in enumerate(zip(expected, actual)):
        assert a.dtype == b.dtype, index
        assert np.array_equal(a, b), f"result {index} differs"


def _loop_graphs(graph):
    """`{name: Counter of op types}` of the while-loop bodies in `graph`."""
    bodies = {}
    for function in graph._functions.values():
        if not hasattr(function, "graph"):
            continue
        if "while_body" in function.graph.name:
            bodies[function.graph.name] = collections.Counter(
                op.type for op in function.graph.get_operations()
            )
        bodies.update(_loop_graphs(function.graph))
    return bodies


def _all_op_counts(graph):
    counts = collections.Counter(op.type for op in graph.get_operations())
    for function in graph._functions.values():
        if hasattr(function, "graph"):
            counts.update(_all_op_counts(function.graph))
    return counts


def _training_graph(layer_name):
    """The graph of a forward and backward pass through a fresh layer."""
    layer = LAYERS[layer_name](8)
    inputs = _inputs()
    layer.build(inputs.shape)

    @tf.function
    def step(inputs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(inputs), "float32"))
        return tape.gradient(loss, layer.trainable_variables)

    return step.get_concrete_function(inputs).graph


# --- Bit-identical results ----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_same_outputs_and_gradients_as_keras(policy, layer_name, mode):
    kmp.set_global_policy(policy)
    expected = _run(layer_name, installed=False, mode=mode)
    actual = _run(layer_name, installed=True, mode=mode)
    _assert_identical(expected, actual)


def test_same_lstm_results_under_xla():
    kmp.set_global_policy("mixed_bfloat16")
    expected = _run("lstm", installed=False, mode="jit")
    actual = _run("lstm", installed=True, mode="jit")
    _assert_identical(expected, actual)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_same_lstm_results_with_layer_options(option, mode):
    kmp.set_global_policy("mixed_bfloat16")
    expected = _run("lstm", False, mode, **OPTIONS[option])
    actual = _run("lstm", True, mode, **OPTIONS[option])
    _assert_identical(expected, actual)


@pytest.mark.parametrize("option", ["go_backwards", "masked", "stateful"])
@pytest.mark.parametrize("layer_name", ["gru", "simple_rnn"])
def test_same_results_with_layer_options(layer_name, option):
    mode = "tf_function"
    kmp.set_global_policy("mixed_bfloat16")
    expected = _run(layer_name, False, mode, **OPTIONS[option])
    actual = _run(layer_name, True, mode, **OPTIONS[option])
    _assert_identical(expected, actual)


def test_dropout_in_training_gives_same_results():
    kmp.set_global_policy("mixed_bfloat16")

    def run(installed):
        keras.utils.set_random_seed(1)
        layer = keras.layers.LSTM(8, dropout=0.5, recurrent_dropout=0.5)
        inputs = _inputs()
        layer.build(inputs.shape)
        _set_installed(installed)
        keras.utils.set_random_seed(2)
        with tf.GradientTape() as tape:
            outputs = layer(inputs, training=True)
            loss = tf.reduce_sum(tf.cast(outputs, "float32"))
        gradients = tape.gradient(loss, layer.trainable_variables)
        return [outputs.numpy()] + [g.numpy() for g in gradients]

    _assert_identical(run(False), run(True))


def test_inexact_mode_same_outputs_close_gradients():
    kmp.set_global_policy("mixed_bfloat16")
    expected = _run("lstm", installed=False)
    actual = _run("lstm", installed=True, exact=False)
    # Outputs (first of each step's results) are the same; the gradients are
    # summed over time steps in bfloat16, so they round differently.
    np.testing.assert_array_equal(expected[0], actual[0])
    for a, b in zip(expected, actual):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05)


# --- The graph ----------------------------------------------------------------


@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_loop_body_reads_and_casts_nothing(layer_name):
    kmp.set_global_policy("mixed_bfloat16")
    _set_installed(False)
    keras_bodies = _loop_graphs(_training_graph(layer_name))
    _set_installed(True)
    kmp_bodies = _loop_graphs(_training_graph(layer_name))

    def forward_counts(bodies, op_type):
        return [
            counts[op_type]
            for name, counts in bodies.items()
            if "_grad" not in name
        ]

    # Keras reads and casts the weights at every step (the test's premise).
    assert min(forward_counts(keras_bodies, "ReadVariableOp")) >= 2
    assert min(forward_counts(keras_bodies, "Cast")) >= 2
    assert set(forward_counts(kmp_bodies, "ReadVariableOp")) == {0}
    assert set(forward_counts(kmp_bodies, "Cast")) == {0}


@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_float32_graph_unchanged(layer_name):
    _set_installed(False)
    keras_counts = _all_op_counts(_training_graph(layer_name))
    _set_installed(True)
    kmp_counts = _all_op_counts(_training_graph(layer_name))
    assert kmp_counts == keras_counts
    assert keras_counts["IdentityN"] == 0


def test_variables_in_compute_dtype_are_left_alone():
    kmp.set_global_policy("float16")
    _set_installed(False)
    keras_counts = _all_op_counts(_training_graph("lstm"))
    _set_installed(True)
    assert _all_op_counts(_training_graph("lstm")) == keras_counts


def test_custom_cell_keeps_keras_loop():
    class Cell(keras.layers.Layer):
        state_size = 4

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 4))

        def call(self, inputs, states):
            output = keras.ops.matmul(inputs, self.kernel) + states[0]
            return output, [output]

    kmp.set_global_policy("mixed_bfloat16")
    _set_installed(True)
    layer = keras.layers.RNN(Cell())
    inputs = _inputs()
    layer.build(inputs.shape)
    bodies = _loop_graphs(
        tf.function(layer).get_concrete_function(inputs).graph
    )
    assert {counts["Cast"] for counts in bodies.values()} == {1}


# --- Installing ---------------------------------------------------------------


def test_install_is_idempotent_and_uninstall_restores_keras():
    _set_installed(False)
    keras_inner_loop = keras_rnn.RNN.inner_loop
    assert not _is_installed()
    _set_installed(True)
    _set_installed(True)
    assert _is_installed()
    assert keras_rnn.RNN.inner_loop is not keras_inner_loop
    assert keras_rnn.RNN.inner_loop.__kmp_original__ is keras_inner_loop
    _set_installed(False)
    _set_installed(False)
    assert not _is_installed()
    assert keras_rnn.RNN.inner_loop is keras_inner_loop


def test_set_exact_rejects_non_bool_exact():
    with pytest.raises(TypeError, match="'exact' must be True or False"):
        recurrent.set_exact("yes")
    assert recurrent._settings.exact is True


# --- Distribution and saving --------------------------------------------------


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((5, 4)),
            keras.layers.LSTM(8, return_sequences=True),
            keras.layers.GRU(8),
            keras.layers.Dense(2, dtype="float32"),
        ]
    )


def test_same_training_step_under_mirrored_strategy(two_replicas):
    kmp.set_global_policy("mixed_bfloat16")
    inputs = _inputs()
    labels = np.array([0, 1, 0, 1][:3], dtype="int32")

    def train(installed):
        _set_installed(installed)
        with two_replicas.scope():
            model = _model()
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
        model.fit(inputs, labels, batch_size=2, epochs=1, verbose=0)
        return [v.numpy() for v in model.trainable_variables]

    _assert_identical(train(False), train(True))


def test_config_and_saved_model_unchanged(tmp_path):
    kmp.set_global_policy("mixed_bfloat16")
    inputs = _inputs()
    _set_installed(False)
    model = _model()
    config = model.get_config()
    expected = model(inputs).numpy()
    _set_installed(True)
    assert model.get_config() == config
    model.save(tmp_path / "model.keras")
    model.export(tmp_path / "saved_model")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(loaded(inputs).numpy(), expected)
    restored = tf.saved_model.load(str(tmp_path / "saved_model"))
    np.testing.assert_array_equal(restored.serve(inputs).numpy(), expected)


def test_importing_kmp_installs_it():
    # The autouse fixture restores whatever a test changed, so at the start
    # of a test the state is the one importing kmp left.
    assert _is_installed()
    assert keras_rnn.RNN.inner_loop.__kmp_patch__ == "recurrent"
    assert recurrent._settings.exact is True
