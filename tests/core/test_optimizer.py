"""Tests for kmp.core.optimizer.LossScaleOptimizer on a single device: its
properties, scaling and unscaling, the checks of `apply_gradients`, and
training that matches the float32 reference bit for bit.

They pin down the "Loss scaling" section of the contract. Many guard against
a Keras 3.15 behaviour: a loss scaled in float16 before the optimizer is
built, gradients unscaled twice in a custom loop. The arguments, the steps
and skips, the recipes, the saved state and `model.compile` have files of
their own; distributed training too.
"""

import functools

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import kmp
from kmp import LossScaleOptimizer
from tests.support import backends
from tests.support import training
from tests.support.training import BATCH_SIZE
from tests.support.training import INF
from tests.support.training import OPTIMIZERS
from tests.support.training import X

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

# --- Properties ---------------------------------------------------------------


def test_properties():
    inner = keras.optimizers.SGD(0.25)
    optimizer = LossScaleOptimizer(
        inner, initial_scale=64, dynamic_growth_steps=10
    )
    assert optimizer.inner_optimizer is inner
    assert optimizer.initial_scale == 64.0
    assert optimizer.dynamic_growth_steps == 10

    scale = optimizer.loss_scale
    assert backends.dtype(scale) == "float32" and tuple(scale.shape) == ()
    assert float(scale) == 64.0
    assert int(optimizer.dynamic_counter) == 0
    assert int(optimizer.skipped_steps) == 0
    assert int(optimizer.iterations) == 0


@pytest.mark.parametrize(
    "name", ["loss_scale", "dynamic_counter", "skipped_steps"]
)
def test_state_properties_are_tensors(name):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.25))
    value = getattr(optimizer, name)
    assert keras.ops.is_tensor(value)
    assert not isinstance(value, keras.Variable)


def test_state_properties_are_values_of_the_moment_they_are_read():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.25), initial_scale=8)
    scale, counter = optimizer.loss_scale, optimizer.dynamic_counter
    skipped = optimizer.skipped_steps
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(backends.tensor([1.0]), variable)])
    optimizer.apply_gradients([(backends.tensor([INF]), variable)])
    assert float(optimizer.loss_scale) == 4.0
    assert (float(scale), int(counter), int(skipped)) == (8.0, 0, 0)


def test_learning_rate_reads_and_assigns_the_inner_optimizer():
    inner = keras.optimizers.SGD(0.25)
    optimizer = LossScaleOptimizer(inner)
    assert float(optimizer.learning_rate) == 0.25

    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate) == 0.5
    assert float(optimizer.learning_rate) == 0.5

    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(backends.tensor([1.0]), variable)])
    # The update used the assigned learning rate: 1 - 0.5 * 1.
    np.testing.assert_array_equal(np.array(variable), [0.5])


def test_lr_is_keras_2s_alias_of_learning_rate():
    # Code ported from tf.keras reads and assigns `lr` (NVIDIA's schedulers:
    # optimizer.lr.assign(...)); Keras 3's optimizers have no `lr`.
    inner = keras.optimizers.SGD(0.25)
    optimizer = LossScaleOptimizer(inner)
    assert float(optimizer.lr) == 0.25
    optimizer.lr = 0.5
    assert float(inner.learning_rate) == 0.5
    optimizer.lr.assign(0.125)
    assert float(optimizer.learning_rate) == 0.125

    def attempt():
        with pytest.raises(ValueError, match="'lr' must be a finite number"):
            optimizer.lr = float("nan")

    training.assert_unchanged_by(optimizer, attempt)
    assert float(inner.learning_rate) == 0.125


@pytest.mark.parametrize("attribute", ["learning_rate", "lr"])
def test_a_learning_rate_variable_is_the_inner_optimizers_only(attribute):
    # Keras tracks a variable assigned to an optimizer attribute: the inner
    # optimizer tracks its learning rate, the wrapper must not track it too
    # (it would be in optimizer.variables twice).
    inner = keras.optimizers.SGD(0.1)
    optimizer = LossScaleOptimizer(inner)
    count = len(optimizer.variables)
    rate = keras.Variable(0.5, name="rate")
    setattr(optimizer, attribute, rate)
    assert float(inner.learning_rate) == 0.5
    assert sum(v is rate for v in optimizer.variables) == 1
    assert len(optimizer.variables) == count + 1


def test_iterations_counts_applied_steps_of_the_inner_optimizer():
    inner = keras.optimizers.SGD(0.1)
    optimizer = LossScaleOptimizer(inner)
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(backends.tensor([1.0]), variable)])
    optimizer.apply_gradients([(backends.tensor([1.0]), variable)])
    assert int(optimizer.iterations) == 2
    assert int(inner.iterations) == 2
    assert int(optimizer.skipped_steps) == 0


def _bad_apply_calls():
    """(id, call(optimizer, kernel, bias), error, message) per bad call."""
    ones = keras.ops.ones
    calls = [
        (
            "string_gradient",
            lambda o, k, b: o.apply_gradients([("x", k)]),
            TypeError,
            r"gradient of '.*kernel' \(position 0\) must be (floating point"
            r"|a floating tensor or None. Received: 'x')",
        ),
        (
            "integer_gradient",
            lambda o, k, b: o.apply_gradients(
                [(ones((4, 2)), k), (ones((2,), "int32"), b)]
            ),
            TypeError,
            r"gradient of '.*bias' \(position 1\) must be floating.*int32",
        ),
        (
            "wrong_shape",
            lambda o, k, b: o.apply_gradients([(ones((2, 4)), k)]),
            ValueError,
            r"'.*kernel' \(position 0\) must have its variable's shape "
            r"\(4, 2\).*shape \(2, 4\)",
        ),
        (
            "string_variable",
            lambda o, k, b: o.apply_gradients([(ones((4, 2)), "kernel")]),
            TypeError,
            r"must be a Keras variable.*position 0: 'kernel'",
        ),
        (
            "not_pairs",
            lambda o, k, b: o.apply_gradients([ones((4, 2)), ones((2,))]),
            TypeError,
            r"\(gradient, variable\) pairs.*position 0: a tensor",
        ),
        (
            "mapping",
            lambda o, k, b: o.apply_gradients({"kernel": ones((4, 2))}),
            TypeError,
            r"'grads_and_vars' must be \(gradient, variable\) pairs",
        ),
        (
            "counts_differ",
            lambda o, k, b: o.apply([ones((4, 2))], [k, b]),
            ValueError,
            "one gradient per variable. Received 1 gradients for 2 variables",
        ),
    ]
    if backends.TENSORFLOW:
        tf = backends.tensorflow()
        calls.append(
            (
                "sparse_wrong_shape",
                lambda o, k, b: o.apply_gradients(
                    [(tf.IndexedSlices(ones((1, 3)), tf.constant([0])), k)]
                ),
                ValueError,
                r"must have its variable's shape \(4, 2\)"
                r".*values of shape \(1, 3\)",
            )
        )
    return calls


@pytest.mark.parametrize("mode", backends.modes("eager", "tf_function"))
@pytest.mark.parametrize(
    "call, error, message",
    [case[1:] for case in _bad_apply_calls()],
    ids=[case[0] for case in _bad_apply_calls()],
)
def test_apply_gradients_rejects_bad_input_and_changes_nothing(
    mode, call, error, message
):
    layer = keras.layers.Dense(2)
    layer.build((None, 4))
    kernel, bias = layer.kernel, layer.bias
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    # One good step first, so there are slots and iterations to keep.
    optimizer.apply_gradients(
        [(keras.ops.ones((4, 2)), kernel), (keras.ops.ones((2,)), bias)]
    )
    weights = training.values([kernel, bias])

    def bad_step():
        call(optimizer, kernel, bias)

    def attempt():
        with pytest.raises(error, match=message):
            training.compiled(bad_step, mode)()

    training.assert_unchanged_by(optimizer, attempt)
    training.assert_weights_equal(training.values([kernel, bias]), weights)
    assert training.optimizer_state(optimizer) == (8.0, 1, 0, 1)


def test_a_wrong_gradient_shape_names_indexed_slices_only_on_tensorflow():
    # Off TensorFlow there is no tf.IndexedSlices to point the user to.
    variable = keras.Variable(np.ones((4, 2), "float32"), name="kernel")
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"shape \(4, 2\)") as raised:
        optimizer.apply_gradients([(keras.ops.ones((2, 4)), variable)])
    assert ("tf.IndexedSlices" in str(raised.value)) == backends.TENSORFLOW


def test_apply_gradients_converts_arrays_and_returns_iterations():
    variable = keras.Variable([1.0, 2.0])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8)
    iterations = optimizer.apply_gradients(
        [(np.array([2.0, 4.0], "float32"), variable)]
    )
    np.testing.assert_array_equal(np.array(variable), [0.0, 0.0])
    assert int(iterations) == 1


def test_variables_start_with_kerass_layout():
    # Changed on purpose: the state variables carry Keras's names and come
    # first in Keras's order, so Keras's own code finds them.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4)
    names = [v.path.split("/")[-1] for v in optimizer.variables]
    assert names[:4] == [
        "iteration",
        "learning_rate",
        "step_counter",
        "dynamic_scale",
    ]
    assert names[4:7] == [
        "skipped_steps",
        "consecutive_skips",
        "hysteresis_left",
    ]
    inner = optimizer.inner_optimizer
    assert optimizer.variables[-len(inner.variables) :] == inner.variables
    assert optimizer.dynamic_scale is optimizer.variables[3]
    assert optimizer.step_counter is optimizer.variables[2]
    assert float(optimizer.dynamic_scale) == 4.0
    # Keras's default int: int64 on TensorFlow, int32 on JAX and torch.
    count_dtype = "int64" if backends.TENSORFLOW else "int32"
    assert optimizer.skipped_steps_variable.dtype == count_dtype
    assert optimizer.consecutive_skips_variable.dtype == count_dtype
    assert int(optimizer.hysteresis_left) == 1


def test_nonfinite_variables_names_the_variables_of_the_last_skip():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=4, record_nonfinite=True
    )
    good = keras.Variable([1.0], name="good")
    bad = keras.Variable([1.0], name="bad")
    assert optimizer.nonfinite_variables == []
    optimizer.apply_gradients(
        [(backends.tensor([1.0]), good), (backends.tensor([INF]), bad)]
    )
    assert optimizer.nonfinite_variables == [bad.path]
    optimizer.apply_gradients(
        [(backends.tensor([1.0]), good), (backends.tensor([1.0]), bad)]
    )
    assert optimizer.nonfinite_variables == [bad.path]  # The last skip's.
    plain = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="record_nonfinite=True"):
        plain.nonfinite_variables  # noqa: B018


@pytest.mark.parametrize(
    "pairs",
    [[], iter([])],
    ids=["empty_list", "exhausted_zip"],
)
def test_apply_gradients_of_no_pairs_is_refused(pairs):
    # Changed on purpose: an exhausted zip used to be a silent no-op.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)

    def attempt():
        with pytest.raises(ValueError, match="holds no \\(gradient, variable"):
            optimizer.apply_gradients(pairs)

    training.assert_unchanged_by(optimizer, attempt)


@pytest.mark.parametrize("container", ["list", "zip"])
def test_get_unscaled_gradients_refuses_gradient_variable_pairs(container):
    # Each pair used to be stacked into one tensor of shape (2, ...), for
    # apply_gradients to refuse later.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=4)
    variable = keras.Variable([1.0, 2.0])
    pairs = zip([backends.tensor([4.0, 8.0])], [variable])
    if container == "list":
        pairs = list(pairs)

    def attempt():
        with pytest.raises(
            TypeError,
            match=r"gradients only, not \(gradient, variable\) pairs.*"
            r"Received: grads\[0\]=\(a tensor .* shape \(2,\), a variable",
        ):
            optimizer.get_unscaled_gradients(pairs)

    training.assert_unchanged_by(optimizer, attempt)


# --- Both recipes give the float32 reference, bit for bit ---------------------


@pytest.mark.parametrize("mode", training.MODES)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fit_matches_the_float32_reference(optimizer_name, mode):
    optimizer = LossScaleOptimizer(OPTIMIZERS[optimizer_name]())
    weights = training.fit_weights(optimizer, mode)
    training.assert_weights_equal(
        weights, training.reference_weights(optimizer_name, mode)
    )
    assert int(optimizer.iterations) == len(X) // BATCH_SIZE
    assert int(optimizer.skipped_steps) == 0


@pytest.mark.parametrize("mode", training.MODES)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_custom_loop_matches_the_float32_reference(optimizer_name, mode):
    optimizer = LossScaleOptimizer(OPTIMIZERS[optimizer_name]())
    weights = training.loop_weights(optimizer, mode, "contract")
    training.assert_weights_equal(
        weights, training.reference_weights(optimizer_name, mode)
    )
    assert int(optimizer.iterations) == len(X) // BATCH_SIZE


# --- End to end under mixed_float16 -------------------------------------------


@functools.lru_cache(maxsize=None)
def _digits():
    digits = load_digits()
    x = (digits.data[:640] / 16.0).astype("float32")
    y = digits.target[:640].astype("int32")
    return x, y


def _digits_model():
    """Dense -> Dense -> Dense logits -> float32 softmax, under the policy."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def _digits_loss(model):
    x, y = _digits()
    loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x))
    return float(keras.ops.convert_to_numpy(loss))


def test_end_to_end_fit_under_mixed_float16():
    kmp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = _digits_model()
    assert model.layers[0].compute_dtype == "float16"
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
    )
    assert isinstance(model.optimizer, LossScaleOptimizer)
    x, y = _digits()
    loss_before = _digits_loss(model)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert _digits_loss(model) < loss_before
    assert backends.dtype(model(x[:4])) == "float32"
    assert int(model.optimizer.iterations) > 0


@pytest.mark.parametrize("mode", [backends.DEFAULT_FIT_MODE])
def test_end_to_end_custom_loop_under_mixed_float16(mode):
    kmp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = _digits_model()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    step = training.loop_step(model, optimizer, loss_fn, "contract", mode)

    x, y = _digits()
    loss_before = _digits_loss(model)
    for start in range(0, len(x), 32):
        step(
            backends.tensor(x[start : start + 32]),
            backends.tensor(y[start : start + 32], "int32"),
        )
    assert _digits_loss(model) < loss_before
    probabilities = model(x[:4])
    assert backends.dtype(probabilities) == "float32"
    grads = backends.gradients(
        lambda: loss_fn(y[:4], model(x[:4], training=True)),
        model.trainable_variables,
    )
    assert all(backends.dtype(g) == "float32" for g in grads)
    assert int(optimizer.iterations) + int(optimizer.skipped_steps) == 20
    assert int(optimizer.iterations) > 0
