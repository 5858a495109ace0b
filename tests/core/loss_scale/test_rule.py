"""Tests for kmp.core.loss_scale: the dynamic loss-scale rule on plain numbers.

Each test walks `ScaleRule.next` one step at a time and checks
`(scale, counter, hysteresis_left)` after every step, against the
pseudo-code in the module docstring.
"""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kmp.core.loss_scale import rule as loss_scale
from kmp.core.loss_scale.rule import ScaleRule
from tests.support import backends

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _walk(scale, growth_steps, finite_steps, **settings):
    """Applies the rule once per entry of `finite_steps`.

    Returns:
        The `(scale, counter)` after each step, as Python numbers (with
        `hysteresis_left` too when `settings` set a hysteresis).
    """
    rule = ScaleRule(growth_steps=growth_steps, **settings)
    state = rule.initial_state(scale)
    states = []
    for finite in finite_steps:
        state = rule.next(state, finite)
        scale, counter, left = state
        if "hysteresis" in settings:
            states.append((float(scale), int(counter), int(left)))
        else:
            assert int(left) == 1
            states.append((float(scale), int(counter)))
    return states


def _reference_rule(rule, state, finite):
    """The docstring's pseudo-code, in plain Python with float32 rounding."""
    scale, counter, left = state
    scale = np.float32(scale)
    if finite:
        counter += 1
        if counter >= rule.growth_steps:
            with np.errstate(over="ignore"):
                grown = scale * np.float32(rule.growth_factor)
            if grown <= np.float32(rule.max_scale):
                scale = grown
            counter = 0
            left = rule.hysteresis
    else:
        counter = 0
        if left <= 1:
            backed_off = scale * np.float32(rule.backoff_factor)
            scale = max(backed_off, np.float32(rule.min_scale))
        else:
            left -= 1
    return scale, counter, left


def test_constants():
    assert loss_scale.DEFAULT_INITIAL_SCALE == 2.0**15
    assert loss_scale.DEFAULT_GROWTH_STEPS == 2000
    assert loss_scale.DEFAULT_GROWTH_FACTOR == 2.0
    assert loss_scale.DEFAULT_BACKOFF_FACTOR == 0.5
    assert loss_scale.DEFAULT_MIN_SCALE == 1.0
    assert loss_scale.MAX_SCALE == FLOAT32_MAX
    assert loss_scale.MAX_INT == 2**31 - 1
    rule = ScaleRule()
    assert (rule.growth_steps, rule.growth_factor, rule.backoff_factor) == (
        2000,
        2.0,
        0.5,
    )
    assert (rule.min_scale, rule.max_scale, rule.hysteresis) == (
        1.0,
        FLOAT32_MAX,
        1,
    )


def test_returns_float32_and_int32_scalars_for_python_numbers():
    rule = ScaleRule(growth_steps=2)
    scale, counter, left = rule.next((8.0, 0, 1), True)
    assert backends.dtype(scale) == "float32" and tuple(scale.shape) == ()
    assert backends.dtype(counter) == "int32" and tuple(counter.shape) == ()
    assert backends.dtype(left) == "int32" and tuple(left.shape) == ()


def _tf_variable(value, dtype):
    return backends.tensorflow().Variable(value, dtype=dtype)


# JAX has no int64 without x64.
COUNTER_DTYPES = ["int32", "int64"] if backends.HAS_FLOAT64 else ["int32"]


def _keras_variable(value, dtype):
    # A keras.Variable of an int dtype on torch must not be trainable.
    return keras.Variable(value, dtype=dtype, trainable=False)


@pytest.mark.parametrize("dtype", COUNTER_DTYPES)
@pytest.mark.parametrize(
    "make_counter",
    [
        backends.tensor,
        _keras_variable,
        pytest.param(_tf_variable, marks=pytest.mark.tensorflow),
    ],
    ids=["tensor", "keras_variable", "tf_variable"],
)
def test_returns_integer_scalars_of_the_counters_dtype(make_counter, dtype):
    # The old rule always returned int64; the new one keeps the counter's.
    scale, counter, left = ScaleRule(growth_steps=3).next(
        (8.0, make_counter(1, dtype), 1), True
    )
    assert backends.dtype(scale) == "float32"
    assert backends.dtype(counter) == backends.dtype(left) == dtype
    assert (int(counter), int(left)) == (2, 1)


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
    scale, counter, _ = ScaleRule(growth_steps=10).next((1.0, 7, 1), False)
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
    scale = keras.Variable(8.0, trainable=False)
    counter = keras.Variable(1, dtype="int32", trainable=False)
    left = backends.tensor(1, "int32")
    new_scale, new_counter, new_left = ScaleRule(growth_steps=2).next(
        (scale, counter, left), backends.tensor(True, "bool")
    )
    assert (float(new_scale), int(new_counter), int(new_left)) == (16.0, 0, 1)


# --- The settings beyond tf.keras's rule --------------------------------------


def test_growth_and_backoff_factors_and_bounds():
    states = _walk(
        8.0,
        1,
        [True, True, True, False, False, False],
        growth_factor=4.0,
        backoff_factor=0.125,
        min_scale=0.5,
        max_scale=200.0,
    )
    # 8 -> 32 -> 128 -> 128 (512 is above max_scale), then / 8 to the floor.
    assert [scale for scale, _ in states] == [
        32.0,
        128.0,
        128.0,
        16.0,
        2.0,
        0.5,
    ]
    assert all(counter == 0 for _, counter in states)


def test_hysteresis_backs_off_on_the_hysteresis_th_skip_after_growth():
    states = _walk(
        64.0,
        2,
        [False, False, False, True, True, False, False, True, False],
        hysteresis=2,
    )
    # (scale, counter, hysteresis_left) after each step.
    assert states == [
        (64.0, 0, 1),  # the first skip leaves the scale alone
        (32.0, 0, 1),  # the second backs off
        (16.0, 0, 1),  # and every one after it, until the scale grows
        (16.0, 1, 1),
        (32.0, 0, 2),  # growth restores the hysteresis
        (32.0, 0, 1),
        (16.0, 0, 1),
        (16.0, 1, 1),  # a finite step alone does not restore it
        (8.0, 0, 1),
    ]


def test_initial_state():
    assert ScaleRule(hysteresis=3).initial_state(8.0) == (8.0, 0, 3)


@pytest.mark.parametrize(
    "settings, error, fragment",
    [
        ({"growth_steps": 0}, ValueError, "'dynamic_growth_steps' must be"),
        ({"growth_steps": 2**31}, ValueError, "at most 2147483647"),
        ({"growth_steps": 1.5}, TypeError, "dynamic_growth_steps=1.5"),
        ({"growth_steps": True}, TypeError, "dynamic_growth_steps=True"),
        ({"growth_factor": 1.0}, ValueError, "'growth_factor' must be"),
        ({"growth_factor": float("inf")}, ValueError, "growth_factor=inf"),
        ({"backoff_factor": 1.0}, ValueError, "'backoff_factor' must be"),
        ({"backoff_factor": 0}, ValueError, "backoff_factor=0"),
        ({"min_scale": 2.0**-25}, ValueError, "'min_scale' must be"),
        ({"max_scale": 1e39}, ValueError, "'max_scale' must be"),
        ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "not be above"),
        ({"hysteresis": 0}, ValueError, "'hysteresis' must be"),
        ({"hysteresis": "2"}, TypeError, "hysteresis='2'"),
    ],
)
def test_settings_are_checked_when_made(settings, error, fragment):
    with pytest.raises(error) as info:
        ScaleRule(**settings)
    assert fragment in str(info.value)


def test_largest_growth_steps_is_accepted():
    assert ScaleRule(growth_steps=2**31 - 1).growth_steps == 2**31 - 1


# --- Settings are the float32 values the rule applies ------------------------


def _float32(value):
    return float(np.float32(value))


@pytest.mark.parametrize(
    "settings",
    [
        {"min_scale": 1e-4},
        {"min_scale": 0.7},
        {"max_scale": 1.1},
        {"growth_factor": 1.1, "backoff_factor": 0.3},
    ],
    ids=["min_scale_1e-4", "min_scale_0.7", "max_scale_1.1", "factors"],
)
def test_settings_are_rounded_to_float32(settings):
    rule = ScaleRule(**settings)
    for name, value in settings.items():
        assert getattr(rule, name) == _float32(value)
        assert type(getattr(rule, name)) is float


@pytest.mark.parametrize("min_scale", [1e-4, 0.7], ids=str)
def test_backoff_lands_exactly_on_a_floor_not_exact_in_float32(min_scale):
    """The floor is the float32 value the scale can hold: the scale stops on
    it, not one float32 step below (which a restore would then refuse)."""
    rule = ScaleRule(min_scale=min_scale)
    state = rule.initial_state(1.0)
    for _ in range(20):
        state = rule.next(state, False)
        scale = float(state[0])
        assert scale >= rule.min_scale
    assert scale == rule.min_scale == _float32(min_scale)


def test_growth_stops_exactly_at_a_ceiling_not_exact_in_float32():
    rule = ScaleRule(growth_steps=1, growth_factor=1.1, max_scale=1.1)
    state = rule.initial_state(1.0)
    for _ in range(3):
        state = rule.next(state, True)
        assert float(state[0]) <= rule.max_scale
    # 1 * float32(1.1) is float32(1.1): the scale reaches the ceiling.
    assert float(state[0]) == rule.max_scale == _float32(1.1)


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"growth_factor": 1 + 1e-9}, "growth_factor=1.000000001, which "),
        ({"backoff_factor": 1 - 1e-9}, "backoff_factor=0.999999999, which "),
    ],
    ids=["growth_factor", "backoff_factor"],
)
def test_a_factor_that_is_one_in_float32_is_refused(settings, fragment):
    """1 + 1e-9 is 1.0 in float32: the scale would silently never move."""
    with pytest.raises(ValueError) as info:
        ScaleRule(**settings)
    assert fragment + "rounds to 1.0 in float32" in str(info.value)


@pytest.mark.parametrize(
    "name", ["growth_factor", "min_scale", "max_scale", "backoff_factor"]
)
def test_float16_inf_is_refused(name):
    """NumPy 2 compares np.float16(inf) with float16(largest float32), inf."""
    with pytest.raises(ValueError, match=rf"{name}=np\.float16\(inf\)"):
        ScaleRule(**{name: np.float16(np.inf)})


@settings(max_examples=40, deadline=None)
@given(
    initial_scale=st.floats(
        min_value=1.0, max_value=FLOAT32_MAX, width=32, allow_nan=False
    ),
    growth_steps=st.integers(min_value=1, max_value=50),
    finite_steps=st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_matches_pseudo_code(initial_scale, growth_steps, finite_steps):
    rule = ScaleRule(growth_steps=growth_steps)
    state = rule.initial_state(initial_scale)
    expected = (np.float32(initial_scale), 0, 1)
    for step, finite in enumerate(finite_steps):
        state = rule.next(state, finite)
        expected = _reference_rule(rule, expected, finite)
        scale, counter, left = state
        assert float(scale) == float(expected[0]), f"step {step}"
        assert int(counter) == expected[1], f"step {step}"
        assert int(left) == expected[2], f"step {step}"
        assert 1.0 <= float(scale) <= FLOAT32_MAX, f"step {step}"
        assert 0 <= int(counter) < growth_steps, f"step {step}"


@settings(max_examples=40, deadline=None)
@given(
    initial_scale=st.floats(min_value=1.0, max_value=2.0**40, width=32),
    growth_steps=st.integers(min_value=1, max_value=5),
    growth_factor=st.sampled_from([1.5, 2.0, 3.0, 16.0]),
    backoff_factor=st.sampled_from([0.1, 0.25, 0.5, 0.9]),
    min_scale=st.sampled_from([2.0**-24, 0.5, 1.0]),
    max_scale=st.sampled_from([2.0**40, 2.0**60, FLOAT32_MAX]),
    hysteresis=st.integers(min_value=1, max_value=4),
    finite_steps=st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_matches_pseudo_code_with_every_setting(
    initial_scale,
    growth_steps,
    growth_factor,
    backoff_factor,
    min_scale,
    max_scale,
    hysteresis,
    finite_steps,
):
    rule = ScaleRule(
        growth_steps=growth_steps,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
    )
    state = rule.initial_state(initial_scale)
    expected = (np.float32(initial_scale), 0, hysteresis)
    for step, finite in enumerate(finite_steps):
        state = rule.next(state, finite)
        expected = _reference_rule(rule, expected, finite)
        scale, counter, left = state
        assert float(scale) == float(expected[0]), f"step {step}"
        assert (int(counter), int(left)) == expected[1:], f"step {step}"
        assert min_scale <= float(scale) <= max_scale, f"step {step}"
        assert 1 <= int(left) <= hysteresis, f"step {step}"


_WALK = [True, True, False, False, False, True]
_WALK_STATES = [(4.0, 1), (8.0, 0), (4.0, 0), (2.0, 0), (1.0, 0), (1.0, 1)]


@pytest.mark.tensorflow
@pytest.mark.parametrize("variable", ["tf", "keras"])
@pytest.mark.parametrize(
    "jit_compile", [False, True], ids=["tf_function", "jit"]
)
def test_runs_inside_tf_function(jit_compile, variable):
    tf = backends.tensorflow()
    variable = tf.Variable if variable == "tf" else keras.Variable
    scale = variable(4.0)
    counter = variable(0, dtype="int64")
    left = variable(1, dtype="int64")
    rule = ScaleRule(growth_steps=2)

    @tf.function(jit_compile=jit_compile)
    def update(finite):
        new_scale, new_counter, new_left = rule.next(
            (scale, counter, left), finite
        )
        scale.assign(new_scale)
        counter.assign(new_counter)
        left.assign(new_left)

    states = []
    for finite in _WALK:
        update(tf.constant(finite))
        states.append((float(np.array(scale)), int(np.array(counter))))
    assert states == _WALK_STATES
    # One trace serves every step: no Python control flow on the values.
    assert update.experimental_get_tracing_count() == 1


@pytest.mark.jax
def test_runs_inside_jax_jit():
    import jax

    rule = ScaleRule(growth_steps=2)
    traces = []

    @jax.jit
    def update(state, finite):
        traces.append(1)
        return rule.next(state, finite)

    state = rule.initial_state(4.0)
    states = []
    for finite in _WALK:
        state = update(state, backends.tensor(finite, "bool"))
        states.append((float(state[0]), int(state[1])))
    assert states == _WALK_STATES
    # One trace serves every step: no Python control flow on the values.
    assert len(traces) == 1


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, True),
        ({"initial_scale": 2.0**-3, "min_scale": 2.0**-10}, True),
        ({"max_scale": 1e5}, True),  # Never clamped to: not a scale.
        ({"initial_scale": 1000.0}, False),
        ({"dynamic": False, "initial_scale": 1024}, True),
        ({"dynamic": False, "initial_scale": 1000}, False),
        ({"dynamic_growth_steps": 3, "growth_factor": 3.0}, False),
        ({"backoff_factor": 0.75}, False),
        ({"min_scale": 3.0}, False),
    ],
)
def test_powers_of_two_tells_whether_every_scale_of_a_run_is_one(
    settings, expected
):
    # What the JAX and TensorFlow steps test to unscale by the reciprocal
    # (tests/core/<backend>/test_step_passes.py).
    import kmp

    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(), **settings)
    assert (
        loss_scale.powers_of_two(optimizer.rule, optimizer.initial_scale)
        is expected
    )
