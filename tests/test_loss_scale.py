"""Tests for kmp.loss_scale: the dynamic loss-scale rule on plain numbers.

Each test walks `next_dynamic_scale` one step at a time and checks
`(scale, counter)` after every step, against the pseudo-code in the module
docstring.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kmp import loss_scale
from kmp.loss_scale import next_dynamic_scale

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _walk(scale, growth_steps, finite_steps):
    """Applies the rule once per entry of `finite_steps`.

    Returns:
        The `(scale, counter)` after each step, as Python numbers.
    """
    counter = 0
    states = []
    for finite in finite_steps:
        scale, counter = next_dynamic_scale(
            scale, counter, finite, growth_steps
        )
        states.append((float(scale), int(counter)))
    return states


def _reference_rule(scale, counter, finite, growth_steps):
    """The docstring's pseudo-code, in plain Python with float32 rounding."""
    scale = np.float32(scale)
    if not finite:
        return max(scale / np.float32(2), np.float32(1)), 0
    if counter + 1 >= growth_steps:
        with np.errstate(over="ignore"):
            doubled = scale * np.float32(2)
        if np.isfinite(doubled):
            scale = doubled
        return scale, 0
    return scale, counter + 1


def test_constants():
    assert loss_scale.DEFAULT_INITIAL_SCALE == 2.0**15
    assert loss_scale.DEFAULT_GROWTH_STEPS == 2000
    assert loss_scale.MIN_SCALE == 1.0
    assert loss_scale.MAX_SCALE == FLOAT32_MAX


def test_returns_float32_and_int64_scalars():
    scale, counter = next_dynamic_scale(8.0, 0, True, growth_steps=2)
    assert scale.dtype == tf.float32 and scale.shape == ()
    assert counter.dtype == tf.int64 and counter.shape == ()


@pytest.mark.parametrize(
    "growth_steps, expected",
    [
        (1, [(16.0, 0), (32.0, 0), (64.0, 0)]),
        (2, [(8.0, 1), (16.0, 0), (16.0, 1), (32.0, 0)]),
        (3, [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (16.0, 2), (32.0, 0)]),
    ],
    ids=["growth_1", "growth_2", "growth_3"],
)
def test_grows_after_growth_steps_finite_steps(growth_steps, expected):
    states = _walk(8.0, growth_steps, [True] * len(expected))
    assert states == expected


def test_non_finite_step_halves_and_resets_counter():
    states = _walk(64.0, 3, [True, True, False, True, False, False])
    assert states == [
        (64.0, 1),
        (64.0, 2),
        (32.0, 0),  # the overflow resets a counter that was about to grow
        (32.0, 1),
        (16.0, 0),
        (8.0, 0),
    ]


def test_halving_stops_at_one():
    states = _walk(4.0, 2, [False] * 4 + [True, True])
    assert states == [
        (2.0, 0),
        (1.0, 0),
        (1.0, 0),
        (1.0, 0),
        (1.0, 1),
        (2.0, 0),
    ]


def test_halving_stops_at_one_from_a_non_power_of_two():
    states = _walk(3.0, 5, [False, False, False])
    assert states == [(1.5, 0), (1.0, 0), (1.0, 0)]


def test_scale_below_floor_is_never_produced_on_overflow():
    scale, counter = next_dynamic_scale(1.0, 7, False, growth_steps=10)
    assert (float(scale), int(counter)) == (1.0, 0)


def test_growth_stops_at_largest_finite_float32():
    states = _walk(2.0**126, 1, [True, True, True])
    # Doubling 2**127 would give inf: the scale stays, the counter restarts.
    assert states == [(2.0**127, 0), (2.0**127, 0), (2.0**127, 0)]
    assert np.isfinite(states[-1][0])


def test_growth_from_float32_max_stays_finite():
    states = _walk(FLOAT32_MAX, 2, [True, True, False])
    assert states == [
        (FLOAT32_MAX, 1),
        (FLOAT32_MAX, 0),
        (float(np.float32(FLOAT32_MAX) / np.float32(2)), 0),
    ]


def test_accepts_tensors_and_variables():
    scale = tf.Variable(8.0)
    counter = tf.Variable(1, dtype=tf.int64)
    new_scale, new_counter = next_dynamic_scale(
        scale, counter, tf.constant(True), growth_steps=2
    )
    assert (float(new_scale), int(new_counter)) == (16.0, 0)


@settings(max_examples=40, deadline=None)
@given(
    initial_scale=st.floats(
        min_value=1.0, max_value=FLOAT32_MAX, width=32, allow_nan=False
    ),
    growth_steps=st.integers(min_value=1, max_value=50),
    finite_steps=st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_matches_pseudo_code(initial_scale, growth_steps, finite_steps):
    scale, counter = initial_scale, 0
    expected_scale, expected_counter = np.float32(initial_scale), 0
    for step, finite in enumerate(finite_steps):
        scale, counter = next_dynamic_scale(
            scale, counter, finite, growth_steps
        )
        expected_scale, expected_counter = _reference_rule(
            expected_scale, expected_counter, finite, growth_steps
        )
        assert float(scale) == float(expected_scale), f"step {step}"
        assert int(counter) == expected_counter, f"step {step}"
        assert 1.0 <= float(scale) <= FLOAT32_MAX, f"step {step}"
        assert 0 <= int(counter) < growth_steps, f"step {step}"


@pytest.mark.parametrize(
    "jit_compile", [False, True], ids=["tf_function", "jit"]
)
def test_runs_inside_tf_function(jit_compile):
    scale = tf.Variable(4.0)
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function(jit_compile=jit_compile)
    def update(finite):
        new_scale, new_counter = next_dynamic_scale(
            scale, counter, finite, growth_steps=2
        )
        scale.assign(new_scale)
        counter.assign(new_counter)

    states = []
    for finite in [True, True, False, False, False, True]:
        update(tf.constant(finite))
        states.append((float(scale.numpy()), int(counter.numpy())))
    assert states == [
        (4.0, 1),
        (8.0, 0),
        (4.0, 0),
        (2.0, 0),
        (1.0, 0),
        (1.0, 1),
    ]
    # One trace serves every step: no Python control flow on the values.
    assert update.experimental_get_tracing_count() == 1
