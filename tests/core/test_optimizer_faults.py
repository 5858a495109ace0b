"""Non-finite steps under mixed_float16: skipped bit for bit, then recovered.

Faults come from `kmp.testing`: inf/NaN written into chosen gradients at
chosen steps (`GradientFaults`), and float16 activations pushed past 65504
(`OverflowAt`). Every skipped step must leave the variables, every optimizer
slot and `iterations` exactly as they were; the scale halves; training goes on
and the loss comes down. A hypothesis test drives the real optimizer through
random finite / non-finite sequences against a plain-Python model of the
scale rule, on every backend; the fault tools are TensorFlow's (skipped
steps in `fit` and custom loops on JAX and torch: tests/core/jax/test_step.py,
tests/core/torch/test_step.py).
"""

import math

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import kmp
from tests.support import backends
from tests.support import reliability as rel

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
# With -n: the compiled steps (`_compiled_steps`) are traced once, on one
# worker.
pytestmark = [pytest.mark.oldest_pair, pytest.mark.xdist_group("faults")]

if backends.TENSORFLOW:
    import tensorflow as tf

    from kmp.testing import GradientFaults
    from kmp.testing import OverflowAt

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _walk(states, bad_steps):
    """Asserts every step: nothing moves on `bad_steps`, weights move else."""
    for step in range(len(states) - 1):
        changed = rel.split_changed(
            rel.frozen(states[step]), rel.frozen(states[step + 1])
        )
        if step in bad_steps:
            assert changed == [], f"skipped step {step} changed {changed}"
        else:
            assert any(p.endswith("kernel") for p in changed), step
            assert any(p.lower().endswith("adam/iteration") for p in changed), (
                step
            )
            assert any("_momentum" in p for p in changed), step
            assert any("_velocity" in p for p in changed), step


def _scale_history(states):
    """The loss scale recorded in each snapshot."""
    history = []
    for state in states:
        (path,) = [p for p in state if p.endswith("dynamic_scale")]
        history.append(float(state[path][0]))
    return history


def _mse(model, x, y):
    return float(np.mean((np.array(model(x)) - y) ** 2))


def _make(layers, faults=None, **optimizer_kwargs):
    keras.utils.set_random_seed(0)
    model = rel.FaultModel(layers, faults=faults)
    optimizer = rel.make_optimizer(
        keras.optimizers.Adam(0.02), **optimizer_kwargs
    )
    return model, optimizer


# --- Custom loop --------------------------------------------------------------


def _custom_loop(model, optimizer, mode, faults):
    def step(x, y, index):
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, model(x, training=True))
            loss = tf.reduce_mean(loss)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled = tape.gradient(scaled_loss, model.trainable_variables)
        grads = faults(optimizer.get_unscaled_gradients(scaled), index)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    if mode == "eager":
        return step
    return tf.function(step, jit_compile=mode == "jit")


@pytest.mark.tensorflow
@pytest.mark.parametrize("mode", ["eager", "tf_function", "jit"])
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_custom_loop_gradient_faults_are_skipped_bit_for_bit(mode, kind):
    kmp.set_global_policy("mixed_float16")
    x, y = rel.make_data()
    faults = GradientFaults({1: (kind, [0]), 2: (kind, [1, 3]), 4: (kind, [2])})
    model, optimizer = _make(rel.make_layers())
    optimizer.build(model.trainable_variables)
    step = _custom_loop(model, optimizer, mode, faults)

    states = [rel.snapshot(model, optimizer)]
    for index in range(6):
        rows = slice(8 * (index % 4), 8 * (index % 4) + 8)
        step(x[rows], y[rows], tf.constant(index, tf.int64))
        states.append(rel.snapshot(model, optimizer))

    _walk(states, bad_steps={1, 2, 4})
    # 16 -> 16 (1 finite) -> 8 -> 4 -> 4 (1 finite) -> 2 -> 2 (1 finite)
    assert _scale_history(states[1:]) == [16.0, 8.0, 4.0, 4.0, 2.0, 2.0]
    assert int(optimizer.skipped_steps) == 3
    assert int(np.array(optimizer.iterations)) == 3


@pytest.mark.tensorflow
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_custom_loop_recovers_after_faults(kind):
    kmp.set_global_policy("mixed_float16")
    x, y = rel.make_data()
    faults = GradientFaults({0: (kind, [0]), 1: (kind, [0, 1, 2, 3])})
    # No growth: every skip below is then one of the two injected faults.
    model, optimizer = _make(rel.make_layers(), dynamic_growth_steps=10**6)
    step = _custom_loop(model, optimizer, "tf_function", faults)
    step(x[:8], y[:8], tf.constant(0, tf.int64))
    step(x[:8], y[:8], tf.constant(1, tf.int64))
    loss_after_faults = _mse(model, x, y)
    for index in range(2, 60):
        rows = slice(8 * (index % 4), 8 * (index % 4) + 8)
        step(x[rows], y[rows], tf.constant(index, tf.int64))
    assert _mse(model, x, y) < 0.5 * loss_after_faults
    assert int(optimizer.skipped_steps) == 2
    assert all(np.isfinite(np.array(w)).all() for w in model.weights)


# --- model.fit ----------------------------------------------------------------


class _Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_begin(self, logs=None):
        self.states.append(rel.snapshot(self.model, self.model.optimizer))

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(rel.snapshot(self.model, self.model.optimizer))


@pytest.mark.tensorflow
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_fit_gradient_faults_are_skipped_then_training_recovers(kind):
    kmp.set_global_policy("mixed_float16")
    x, y = rel.make_data()
    faults = GradientFaults({1: (kind, [0]), 2: (kind, [3]), 5: (kind, [1])})
    model, optimizer = _make(rel.make_layers(), faults=faults)
    model.compile(optimizer=optimizer, loss="mse")
    record = _Record()
    model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
        callbacks=[record],
    )  # fmt: skip

    _walk(record.states, bad_steps={1, 2, 5})
    assert _scale_history(record.states[1:]) == [
        16.0, 8.0, 4.0, 4.0, 8.0, 4.0, 4.0, 8.0,
    ]  # fmt: skip
    assert int(optimizer.skipped_steps) == 3
    loss_after_faults = _mse(model, x, y)
    # The scale doubles every 2 steps here, so float16 overflows now and then
    # as it would in real training; those steps are skipped too.
    model.fit(x, y, batch_size=8, epochs=12, shuffle=False, verbose=0)
    assert _mse(model, x, y) < 0.8 * loss_after_faults
    assert all(np.isfinite(np.array(w)).all() for w in model.weights)


# --- Forward-pass overflow ----------------------------------------------------


@pytest.mark.tensorflow
def test_fit_forward_overflow_in_float16_is_a_skipped_step():
    kmp.set_global_policy("mixed_float16")
    x, y = rel.make_data()
    model, optimizer = _make(rel.make_layers(extra=[OverflowAt(steps=[2])]))
    model.compile(optimizer=optimizer, loss="mse")
    record = _Record()
    model.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
        callbacks=[record],
    )  # fmt: skip

    _walk(record.states, bad_steps={2})
    assert _scale_history(record.states[1:]) == [16.0, 32.0, 16.0, 16.0]
    assert int(optimizer.skipped_steps) == 1
    assert all(np.isfinite(np.array(w)).all() for w in model.weights)


@pytest.mark.tensorflow
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_custom_loop_forward_overflow_in_float16_is_a_skipped_step(mode):
    kmp.set_global_policy("mixed_float16")
    x, y = rel.make_data()
    overflow = OverflowAt(steps=[0, 3])
    model, optimizer = _make(rel.make_layers(extra=[overflow]))
    optimizer.build(model.trainable_variables)
    step = _custom_loop(model, optimizer, mode, GradientFaults({}))

    states = [rel.snapshot(model, optimizer)]
    for index in range(4):
        rows = slice(8 * index, 8 * index + 8)
        step(x[rows], y[rows], tf.constant(index, tf.int64))
        states.append(rel.snapshot(model, optimizer))

    _walk(states, bad_steps={0, 3})
    assert int(np.array(overflow.calls)) == 4
    assert int(optimizer.skipped_steps) == 2


# --- Property: the optimizer follows the scale rule, step by step ------------


def _rule(scale, counter, finite, growth_steps):
    """The dynamic loss-scale rule in plain Python, in float32 as kmp."""
    if not finite:
        return max(np.float32(scale) / np.float32(2), np.float32(1)), 0
    if counter + 1 >= growth_steps:
        with np.errstate(over="ignore"):
            doubled = np.float32(scale) * np.float32(2)
        return (doubled if np.isfinite(doubled) else np.float32(scale)), 0
    return np.float32(scale), counter + 1


_BAD_VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


_LEARNING_RATE = 0.125
_START = [1.0, -1.0]
_compiled_steps = {}


def _fresh_optimizer(initial_scale, growth_steps):
    variable = keras.Variable(_START, name="w")
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(_LEARNING_RATE),
        initial_scale=initial_scale,
        dynamic_growth_steps=growth_steps,
    )
    optimizer.build([variable])
    return variable, optimizer


def _eager_optimizer(initial_scale, growth_steps):
    variable, optimizer = _fresh_optimizer(initial_scale, growth_steps)

    def step(gradient):
        optimizer.apply_gradients([(backends.tensor(gradient), variable)])

    return variable, optimizer, step


def _compiled_step(optimizer, variable):
    """One step `step(gradient)` that the backend compiles once."""
    if backends.TENSORFLOW:
        return tf.function(
            lambda g: optimizer.apply_gradients([(g, variable)]),
            input_signature=[tf.TensorSpec([2], tf.float32)],
        )
    import jax

    jitted = jax.jit(optimizer.stateless_apply)

    def step(gradient):
        new_values, optimizer_values = jitted(
            [v.value for v in optimizer.variables],
            [gradient],
            [variable.value],
        )
        variable.assign(new_values[0])
        for state, value in zip(optimizer.variables, optimizer_values):
            state.assign(value)

    return step


def _compiled_optimizer(initial_scale, growth_steps):
    """One compiled step per growth_steps, reused across examples.

    The optimizer is reset through its public `variables` to the state a
    new one with `initial_scale` would have.
    """
    if growth_steps not in _compiled_steps:
        variable, optimizer = _fresh_optimizer(1.0, growth_steps)
        step = _compiled_step(optimizer, variable)
        _compiled_steps[growth_steps] = variable, optimizer, step
    variable, optimizer, step = _compiled_steps[growth_steps]
    variable.assign(_START)
    for state in optimizer.variables:
        if state.path.endswith("dynamic_scale"):
            state.assign(initial_scale)
        elif state.path.endswith("hysteresis_left"):
            state.assign(1)  # The rule's hysteresis, 1 by default.
        elif state.dtype.startswith("int"):
            state.assign(0)  # Counters and iterations.
    return variable, optimizer, lambda g: step(backends.tensor(g))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_eager_optimizer, id="eager"),
        pytest.param(
            _compiled_optimizer,
            id="compiled",  # tf.function; jax.jit over stateless_apply.
            marks=[pytest.mark.tensorflow, pytest.mark.jax],
        ),
    ],
)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    steps=st.lists(
        st.sampled_from(["ok", "ok", "inf", "-inf", "nan"]),
        min_size=1,
        max_size=12,
    ),
    initial_scale=st.one_of(
        st.floats(1.0, 2.0**40),
        st.sampled_from([1.0, 2.0**126, 2.0**127, _FLOAT32_MAX]),
    ),
    growth_steps=st.integers(1, 4),
)
def test_optimizer_follows_the_scale_rule(
    make, steps, initial_scale, growth_steps
):
    variable, optimizer, step = make(initial_scale, growth_steps)
    scale, counter = np.float32(initial_scale), 0
    assert float(optimizer.loss_scale) == scale
    weights, iterations, skipped = np.array(variable), 0, 0
    for kind in steps:
        finite = kind == "ok"
        step([0.5, _BAD_VALUES.get(kind, 0.25)])

        scale, counter = _rule(scale, counter, finite, growth_steps)
        iterations, skipped = iterations + finite, skipped + (not finite)
        if finite:
            update = np.float32(_LEARNING_RATE) * np.float32([0.5, 0.25])
            weights = weights - update
        assert float(optimizer.loss_scale) == float(scale), kind
        assert int(optimizer.dynamic_counter) == counter, kind
        assert 1.0 <= float(optimizer.loss_scale) <= _FLOAT32_MAX
        assert np.array(variable).tobytes() == weights.tobytes(), kind
        assert int(np.array(optimizer.iterations)) == iterations
        assert int(optimizer.skipped_steps) == skipped
