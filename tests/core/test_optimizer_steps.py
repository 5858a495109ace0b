"""Tests for LossScaleOptimizer's steps: which are skipped, and what a skipped
step leaves behind (kmp.core.tensorflow.step, kmp.core.loss_scale.state).

A step with any inf or NaN gradient is skipped: the variables, the inner
optimizer's slots and `iterations` stay exactly as they were, and the scale
backs off, never below 1 (Keras 3.15 halves on to 0 and doubles to inf).
The state machine is walked one step at a time, in custom loops and `fit`,
in every mode of the backend (eagerly, in a tf.function, under XLA; on JAX
eagerly and jitted).
"""

import warnings

import keras
import numpy as np
import pytest

from kmp import LossScaleOptimizer
from kmp.core.optimizer import PersistentSkipsWarning
from tests.support import backends
from tests.support import training
from tests.support.training import BATCH_SIZE
from tests.support.training import INF
from tests.support.training import MODES
from tests.support.training import NAN
from tests.support.training import X
from tests.support.training import Y

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair


def test_skipped_steps_counts_non_finite_steps():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(backends.tensor([INF]), variable)])
    optimizer.apply_gradients([(backends.tensor([NAN]), variable)])
    # Keras's default int: int64 on TensorFlow, int32 on JAX and torch.
    assert backends.dtype(optimizer.skipped_steps) == (
        "int64" if backends.TENSORFLOW else "int32"
    )
    assert int(optimizer.skipped_steps) == 2
    assert int(optimizer.iterations) == 0
    np.testing.assert_array_equal(np.array(variable), [1.0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "gradients",
    [
        ([INF], [-INF]),  # each alone is inf; their sums add up to NaN
        ([INF, 1.0], [1.0, -INF]),  # same shape, added elementwise first
        ([INF, -INF], [1.0]),  # cancels within one gradient: NaN
        ([1.0, 2.0], [NAN, 1.0], [3.0]),
    ],
    ids=[
        "inf_in_one_minus_inf_in_other",
        "inf_and_minus_inf_in_same_shapes",
        "inf_minus_inf",
        "nan",
    ],
)
def test_any_non_finite_gradient_skips_the_step(mode, gradients):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1)
    variables = [
        keras.Variable(np.ones(len(g), "float32"), name=f"v{i}")
        for i, g in enumerate(gradients)
    ]
    grads = [backends.tensor(g) for g in gradients]
    training.apply_step(optimizer, grads, variables, mode)
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == 0
    for variable in variables:
        np.testing.assert_array_equal(np.array(variable), 1.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "gradients",
    [
        ([3e38, 3e38], [1.0]),  # finite elements whose sum overflows
        ([3e38], [3e38]),  # finite gradients whose elementwise sum does
        ([-3e38, -3e38], [3e38, 3e38]),  # and both signs at once
    ],
    ids=["sum_overflow", "elementwise_overflow", "both_signs"],
)
def test_finite_gradients_whose_sum_overflows_are_applied(mode, gradients):
    # Changed on purpose: the finite check is exact, elementwise; finite
    # gradients whose sum overflows used to skip the step.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1)
    variables = [
        keras.Variable(np.ones(len(g), "float32"), name=f"v{i}")
        for i, g in enumerate(gradients)
    ]
    grads = [backends.tensor(g) for g in gradients]
    training.apply_step(optimizer, grads, variables, mode)
    assert int(optimizer.skipped_steps) == 0
    assert int(optimizer.iterations) == 1
    assert float(optimizer.loss_scale) == 1.0
    for variable, gradient in zip(variables, gradients):
        expected = np.float32(1.0) - np.float32(0.1) * np.float32(gradient)
        np.testing.assert_array_equal(np.array(variable), expected)
        assert np.isfinite(np.array(variable)).all()


@pytest.mark.parametrize("mode", MODES)
def test_finite_gradients_that_cancel_are_applied(mode):
    # Same-shape gradients are added elementwise for the check: large values
    # that cancel there must not be mistaken for anything else.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1)
    variables = [keras.Variable([0.0, 0.0]), keras.Variable([0.0, 0.0])]
    grads = [backends.tensor([1e38, -2.0]), backends.tensor([-1e38, 2.0])]
    training.apply_step(optimizer, grads, variables, mode)
    assert int(optimizer.skipped_steps) == 0
    expected = np.array([-1e38, 2.0], "float32")
    np.testing.assert_array_equal(np.array(variables[0]), expected)
    np.testing.assert_array_equal(np.array(variables[1]), -expected)


@pytest.mark.tensorflow
@pytest.mark.jax  # Keras's torch trainer has no steps_per_execution.
def test_fit_skips_a_nan_batch_within_steps_per_execution():
    # With steps_per_execution, fit runs several steps in one tf.function
    # (a loop); the skipped step must be undone inside it like any other.
    x = np.concatenate([X, X]).copy()
    x[9, 1] = NAN  # the second of six batches
    y = np.concatenate([Y, Y])
    results = []
    for steps_per_execution in (1, 3):
        optimizer = LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=8
        )
        model = training.model()
        model.compile(
            optimizer=optimizer,
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
        model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
        assert int(optimizer.skipped_steps) == 1
        assert int(optimizer.iterations) == 5
        results.append(model.get_weights())
    for one, three in zip(*results):
        assert np.all(np.isfinite(three))
        np.testing.assert_array_equal(three, one)


# --- Persistent skips ---------------------------------------------------------

# In a tf.function the inner update is applied first and undone on a skip
# ("first"), or applied in a cond ("in_cond"); see kmp.core.tensorflow.step. A
# jitted JAX step reports from the host: tests/core/jax/test_step.py.
SKIP_PATHS = [
    "eager",
    pytest.param("first", marks=pytest.mark.tensorflow),
    pytest.param("in_cond", marks=pytest.mark.tensorflow),
]


def _skip_stepper(optimizer, path, monkeypatch):
    if path == "in_cond":
        from kmp.core.tensorflow import step as tf_step

        monkeypatch.setattr(tf_step, "RESTORE_MAX_ELEMENTS", 0)
    variable = keras.Variable([1.0])

    def step(value):
        optimizer.apply_gradients([(backends.tensor([value]), variable)])

    if path == "eager":
        return step, variable
    return backends.tensorflow().function(step), variable


def _reports(caught):
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("path", SKIP_PATHS)
def test_persistent_skips_warn_once_with_the_scale(path, monkeypatch):
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), max_consecutive_skips=3
    )
    step, _ = _skip_stepper(optimizer, path, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(INF)
        step(NAN)
        assert not _reports(caught)
        step(INF)
        reports = _reports(caught)
        assert len(reports) == 1
        assert reports[0].category is PersistentSkipsWarning
        message = str(reports[0].message)
        assert "skipped the last 3 steps in a row" in message
        assert "the loss scale is now 4096." in message
        step(1.0)
        for _ in range(3):
            step(INF)
    assert len(_reports(caught)) == 1  # once per optimizer
    assert int(optimizer.skipped_steps) == 6
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("path", SKIP_PATHS)
def test_persistent_skips_raise_when_asked(path, monkeypatch):
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        dynamic=False,
        initial_scale=128,
        max_consecutive_skips=2,
        on_persistent_skips="raise",
    )
    step, variable = _skip_stepper(optimizer, path, monkeypatch)
    step(1.0)
    step(INF)
    # Inside a tf.function TensorFlow re-raises it as an UnknownError whose
    # message starts with the FloatingPointError.
    expected = FloatingPointError
    if path != "eager":
        expected = backends.tensorflow().errors.UnknownError
    with pytest.raises(expected, match="skipped the last 2 steps in a row"):
        try:
            step(INF)
        except expected as error:
            assert "the loss scale is now 128." in str(error)
            raise
    # The step that raised was skipped like any other: nothing changed.
    np.testing.assert_array_equal(np.array(variable), np.float32([0.9]))
    assert int(optimizer.iterations) == 1
    assert int(optimizer.inner_optimizer.iterations) == 1
    # Changed on purpose: it raises on every step at or beyond the limit,
    # not only on the one that reaches it.
    with pytest.raises(expected, match="skipped the last 3 steps in a row"):
        step(NAN)
    assert int(optimizer.skipped_steps) == 3
    # A finite step ends the run of skips; one skip alone is no alarm.
    step(1.0)
    step(INF)
    assert int(optimizer.iterations) == 2
    assert int(optimizer.consecutive_skips) == 1


# --- Dynamic and fixed scales, one step at a time -----------------------------


@pytest.mark.parametrize("how", training.HARNESSES)
def test_dynamic_scale_walk(how):
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=8, dynamic_growth_steps=2
    )
    harness = training.Harness(optimizer, how)
    harness.walk(
        [1.0, 1.0, INF, 1.0, NAN, 1.0, 1.0],
        # (scale, counter, skipped_steps, iterations) after each step.
        [
            (8.0, 1, 0, 1),
            (16.0, 0, 0, 2),
            (8.0, 0, 1, 2),
            (8.0, 1, 1, 3),
            (4.0, 0, 2, 3),
            (4.0, 1, 2, 4),
            (8.0, 0, 2, 5),
        ],
    )


@pytest.mark.parametrize("how", training.FEWER_HARNESSES)
def test_scale_halves_no_lower_than_one(how):
    # Keras halves on to 0.125 here, and a scale of 0 would write NaN.
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=4)
    harness = training.Harness(optimizer, how)
    harness.walk(
        [INF] * 5 + [1.0],
        [
            (2.0, 0, 1, 0),
            (1.0, 0, 2, 0),
            (1.0, 0, 3, 0),
            (1.0, 0, 4, 0),
            (1.0, 0, 5, 0),
            (1.0, 1, 5, 1),
        ],
    )


@pytest.mark.parametrize(
    "how",
    sorted(
        {"loop_eager", f"loop_{MODES[-1]}", f"fit_{backends.DEFAULT_FIT_MODE}"}
    ),
)
def test_scale_does_not_grow_past_the_largest_float32(how):
    # Keras doubles 2**127 to inf. A tiny loss keeps 2**127 * loss finite.
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=2.0**127,
        dynamic_growth_steps=1,
    )
    harness = training.Harness(optimizer, how)
    tiny = 2.0**-100
    harness.walk(
        [tiny, tiny, tiny],
        [(2.0**127, 0, 0, 1), (2.0**127, 0, 0, 2), (2.0**127, 0, 0, 3)],
    )


@pytest.mark.parametrize("how", training.FEWER_HARNESSES)
def test_fixed_scale_never_changes_and_still_skips(how):
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), dynamic=False, initial_scale=64
    )
    harness = training.Harness(optimizer, how)
    harness.walk(
        [1.0, INF, 1.0, NAN, 1.0],
        [
            (64.0, None, 0, 1),
            (64.0, None, 1, 1),
            (64.0, None, 1, 2),
            (64.0, None, 2, 2),
            (64.0, None, 2, 3),
        ],
    )
