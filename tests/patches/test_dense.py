"""Tests for the `dense` patch: float32 Dense layers keep a low-precision input.

Each result is compared bit for bit with Keras's own `Dense.call` (the patch
uninstalled): outputs, the gradient of every variable and of the
input. The graph tests check the point of it: no gradient op reads the
float32 copy of the low-precision input.
"""

import pytest

from tests.support import backends

# TensorFlow only: skipped, before anything imports it, elsewhere.
backends.require("tensorflow")
# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = [pytest.mark.tensorflow, pytest.mark.oldest_pair]

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402
from kmp.patches import dense  # noqa: E402


def _is_installed():
    return "dense" in kmp.patches.installed()


def _set_installed(installed):
    # The autouse fixture in conftest.py puts the patches back afterwards.
    if installed:
        kmp.patches.install("dense")
    else:
        kmp.patches.uninstall("dense")


def _model(policy, *, activation=None, use_bias=True, features=24):
    keras.utils.set_random_seed(3)
    with kmp.policy_scope(policy):
        return keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(
                    10,
                    dtype="float32",
                    activation=activation,
                    use_bias=use_bias,
                ),
            ]
        )


def _forward_and_gradients(model, x, mode):
    """The output and the gradients of the input and of every variable."""

    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)
            # A weighted sum, so that every output gets its own gradient.
            loss = tf.reduce_sum(y * tf.range(10, dtype=tf.float32))
        return y, tape.gradient(loss, [x, *model.trainable_variables])

    if mode != "eager":
        run = tf.function(run, jit_compile=mode == "xla")
    y, grads = run(x)
    return y.numpy(), [g.numpy() for g in grads]


def _batch(features=24, rows=16):
    values = np.random.default_rng(0).normal(size=(rows, features))
    return tf.constant(values.astype("float32"))


def _assert_same(actual, expected):
    assert actual[0].dtype == expected[0].dtype
    np.testing.assert_array_equal(actual[0], expected[0])
    assert len(actual[1]) == len(expected[1])
    for a, e in zip(actual[1], expected[1]):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
@pytest.mark.parametrize(
    "policy, activation, use_bias",
    [
        ("mixed_bfloat16", None, True),
        ("mixed_bfloat16", "softmax", True),
        ("mixed_bfloat16", "relu", False),
        ("mixed_float16", None, True),
        ("mixed_float16", "softmax", False),
    ],
)
def test_outputs_and_gradients_are_bit_identical_to_keras(
    policy, activation, use_bias, mode
):
    x = _batch()
    results = []
    for installed in (False, True):
        _set_installed(installed)
        model = _model(policy, activation=activation, use_bias=use_bias)
        results.append(_forward_and_gradients(model, x, mode))
    _assert_same(results[1], results[0])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_gradients_of_gradients_agree_to_rounding(policy):
    # A gradient penalty differentiates the backward pass itself. kmp's
    # backward runs the same kernels, but TensorFlow adds up the
    # second-order terms in another order, so they agree to the rounding of
    # the compute dtype rather than bit for bit (documented in
    # kmp.patches.dense).
    x = _batch()

    def penalty_gradients(model):
        @tf.function
        def run(x):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    loss = tf.reduce_sum(model(x) * tf.range(10.0))
                input_gradient = inner.gradient(loss, x)
                penalty = tf.reduce_sum(input_gradient**2)
            grads = outer.gradient(penalty, model.trainable_variables)
            return penalty, grads

        penalty, grads = run(x)
        return penalty.numpy(), [g for g in grads if g is not None]

    results = []
    for installed in (False, True):
        _set_installed(installed)
        results.append(penalty_gradients(_model(policy, activation="tanh")))
    (penalty, expected), (kmp_penalty, actual) = results
    assert kmp_penalty == penalty
    assert len(actual) == len(expected) > 0
    # 2**-7: a few units in the last place of bfloat16 (8 significant bits).
    for a, e in zip(actual, expected):
        scale = np.max(np.abs(e.numpy()))
        np.testing.assert_allclose(a.numpy(), e.numpy(), atol=scale * 2**-7)


def _gradient_graph(model, features=24):
    def run(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, model.trainable_variables)

    spec = tf.TensorSpec((16, features), tf.float32)
    return tf.function(run).get_concrete_function(spec).graph


_VIEWS = ("Reshape", "Transpose", "Identity")


def _gradient_readers_of_float32_copies(graph):
    """Gradient ops reading a forward bf16/f16 -> f32 cast (or a view of it).

    A view (Reshape, e.g. in Keras's tensordot for sequence inputs) shares
    the copy's buffer, so reading it keeps the copy alive too.
    """
    readers = []
    for op in graph.get_operations():
        if op.type != "Cast" or op.outputs[0].dtype != tf.float32:
            continue
        if op.inputs[0].dtype not in (tf.bfloat16, tf.float16):
            continue
        if "gradient_tape" in op.name:
            continue  # A cast made in the backward pass itself.
        copies = [op.outputs[0]]
        while copies:
            for consumer in copies.pop().consumers():
                if "gradient_tape" in consumer.name:
                    readers.append(consumer)
                elif consumer.type in _VIEWS:
                    copies.extend(consumer.outputs)
    return readers


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_backward_pass_does_not_keep_the_float32_copy(policy):
    _set_installed(False)
    keras_graph = _gradient_graph(_model(policy))
    assert _gradient_readers_of_float32_copies(keras_graph)
    _set_installed(True)
    kmp_graph = _gradient_graph(_model(policy))
    assert not _gradient_readers_of_float32_copies(kmp_graph)


@pytest.mark.skipif(
    not dense._keras_matmul_uses_tensordot(),
    reason="before Keras 3.15 the patch leaves sequence inputs to Keras",
)
def test_sequence_output_layer_does_not_keep_the_float32_copy():
    def sequence_model():
        with kmp.policy_scope("mixed_bfloat16"):
            return keras.Sequential(
                [
                    keras.Input((6, 24)),
                    keras.layers.Dense(32, activation="relu"),
                    keras.layers.Dense(10, dtype="float32"),
                ]
            )

    def graph(model):
        def run(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            return tape.gradient(loss, model.trainable_variables)

        spec = tf.TensorSpec((None, 6, 24), tf.float32)
        return tf.function(run).get_concrete_function(spec).graph

    _set_installed(False)
    assert _gradient_readers_of_float32_copies(graph(sequence_model()))
    _set_installed(True)
    assert not _gradient_readers_of_float32_copies(graph(sequence_model()))


def _takes_kmp_path(layer, x):
    """Whether a traced call of `layer` on `x` ran kmp's product."""
    calls = []
    product = dense._product

    def counted(*args):
        calls.append(args)
        return product(*args)

    dense._product = counted
    try:
        tf.function(layer).get_concrete_function(x)
    finally:
        dense._product = product
    return bool(calls)


def _bfloat16_cast_input(features=8):
    return tf.TensorSpec((4, features), tf.bfloat16)


def test_float32_dense_fed_low_precision_takes_kmp_path():
    layer = keras.layers.Dense(3, dtype="float32")
    assert _takes_kmp_path(layer, _bfloat16_cast_input())
    assert _takes_kmp_path(layer, tf.TensorSpec((4, 8), tf.float16))


def test_other_inputs_and_layers_keep_keras_path():
    # A float32 input: no low-precision source.
    assert not _takes_kmp_path(
        keras.layers.Dense(3), tf.TensorSpec((4, 8), tf.float32)
    )
    # The input's last dimension unknown (the layer was built with it).
    built = keras.layers.Dense(3, dtype="float32")
    built.build((None, 8))
    assert not _takes_kmp_path(built, tf.TensorSpec((2, 4, None), tf.bfloat16))
    # A layer computing in bfloat16 gets no float32 copy to begin with.
    assert not _takes_kmp_path(
        keras.layers.Dense(3, dtype="mixed_bfloat16"), _bfloat16_cast_input()
    )

    class OwnCall(keras.layers.Dense):
        def call(self, inputs, training=None):
            return super().call(inputs, training=training) + inputs[:, :3]

    # A subclass with its own call may use the input elsewhere.
    assert not _takes_kmp_path(
        OwnCall(3, dtype="float32"), _bfloat16_cast_input()
    )

    lora = keras.layers.Dense(3, dtype="float32")
    lora.build((None, 8))
    lora.enable_lora(2)
    assert not _takes_kmp_path(lora, _bfloat16_cast_input())

    quantized = keras.layers.Dense(3, dtype="float32")
    quantized.build((None, 8))
    quantized.quantize("int8")
    assert not _takes_kmp_path(quantized, _bfloat16_cast_input())


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((4, 6, 8), (4, 6, 8)),
        ((4, 6, 8), (None, None, 8)),
        ((2, 3, 5, 8), None),
    ],
    ids=["rank3", "rank3_unknown_batch_and_time", "rank4"],
)
def test_sequence_inputs_are_bit_identical_to_keras(shape, spec):
    rng = np.random.default_rng(5)
    x = tf.cast(
        tf.constant(rng.normal(size=shape).astype("float32")), "bfloat16"
    )
    results = []
    for installed in (False, True):
        _set_installed(installed)
        keras.utils.set_random_seed(1)
        layer = keras.layers.Dense(10, dtype="float32", activation="softmax")
        layer.build((None, 8))

        @tf.function(
            input_signature=[tf.TensorSpec(spec or shape, tf.bfloat16)]
        )
        def run(x, layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
                loss = tf.reduce_sum(y * tf.range(10, dtype=tf.float32))
            return y, tape.gradient(loss, [x, *layer.trainable_variables])

        y, grads = run(x)
        assert y.shape == (*shape[:-1], 10)
        results.append((y.numpy(), [g.numpy() for g in grads]))
    # Before Keras 3.15 a sequence input is left to Keras's own call.
    assert (
        _takes_kmp_path(layer, tf.TensorSpec(spec or shape, tf.bfloat16))
        == dense._keras_matmul_uses_tensordot()
    )
    _assert_same(results[1], results[0])


def test_subclass_without_own_call_gets_identical_results():
    class Named(keras.layers.Dense):
        pass

    x = tf.cast(_batch(features=8), tf.bfloat16)
    results = []
    for installed in (False, True):
        _set_installed(installed)
        keras.utils.set_random_seed(1)
        layer = Named(10, dtype="float32")
        layer.build((None, 8))
        results.append(_forward_and_gradients(layer, x, "tf_function"))
    assert _takes_kmp_path(layer, _bfloat16_cast_input())
    _assert_same(results[1], results[0])


def _weights_after_fit(policy, make_optimizer, strategy=None):
    """Weights after fitting `_model(policy)`: Keras's Dense, then kmp's."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 24)).astype("float32")
    y = rng.integers(0, 10, size=64)
    strategy = strategy or tf.distribute.get_strategy()
    weights = []
    for installed in (False, True):
        _set_installed(installed)
        with strategy.scope():
            model = _model(policy)
            model.compile(
                optimizer=make_optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    return weights


def _assert_same_weights(weights):
    keras_weights, kmp_weights = weights
    assert len(kmp_weights) == len(keras_weights)
    for a, e in zip(kmp_weights, keras_weights):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_fit_with_loss_scaling_trains_bit_identically(policy):
    def make_optimizer():
        optimizer = keras.optimizers.Adam(1e-2)
        if policy == "mixed_float16":
            return kmp.LossScaleOptimizer(optimizer)
        return optimizer

    _assert_same_weights(_weights_after_fit(policy, make_optimizer))


def test_fit_on_two_replicas_trains_bit_identically(two_replicas):
    weights = _weights_after_fit(
        "mixed_bfloat16", lambda: keras.optimizers.SGD(0.1), two_replicas
    )
    _assert_same_weights(weights)


def test_exported_model_serves_the_same_outputs(tmp_path):
    model = _model("mixed_bfloat16")
    x = _batch()
    expected = model(x).numpy()
    model.export(str(tmp_path / "saved_model"), verbose=False)
    restored = tf.saved_model.load(str(tmp_path / "saved_model"))
    np.testing.assert_array_equal(restored.serve(x).numpy(), expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_input_gradient_is_the_matmul_gradient_cast_to_the_input_dtype(dtype):
    # What benchmarks/memory_breakdown.py overrides (was
    # kmp.patches.dense._input_gradient).
    rng = np.random.default_rng(4)
    upstream = tf.constant(rng.normal(size=(16, 10)).astype("float32"))
    kernel = tf.constant(rng.normal(size=(24, 10)).astype("float32"))
    gradient = dense.input_gradient(upstream, kernel, tf.as_dtype(dtype))
    assert gradient.dtype == tf.as_dtype(dtype)
    expected = tf.cast(tf.matmul(upstream, kernel, transpose_b=True), dtype)
    np.testing.assert_array_equal(gradient.numpy(), expected.numpy())


def test_install_is_idempotent_and_uninstall_restores_keras():
    _set_installed(False)
    keras_call = keras.layers.Dense.call
    assert not hasattr(keras_call, "__kmp_patch__")
    _set_installed(True)
    _set_installed(True)
    assert _is_installed()
    assert keras.layers.Dense.call.__kmp_patch__ == "dense"
    assert keras.layers.Dense.call.__kmp_original__ is keras_call
    _set_installed(False)
    _set_installed(False)
    assert not _is_installed()
    assert keras.layers.Dense.call is keras_call


def test_importing_kmp_installs_it():
    # The autouse fixture restores the state each test found.
    assert _is_installed()
    assert keras.layers.Dense.call.__kmp_patch__ == "dense"
