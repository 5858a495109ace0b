"""Tests for kmp.core.loss_scale.arguments: `LossScaleOptimizer`'s arguments.

Every bad argument is refused at the constructor with a TypeError or
ValueError naming it, before anything changes: Keras 3.15's constructor
accepts anything and mutates the inner optimizer. Also the settings a valid
optimizer reports, and the fuzzing of the constructor and of
`learning_rate` assignment.
"""

import decimal
import fractions
import json

import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import strategies as st

import kmp
from kmp import LossScaleOptimizer
from kmp import mixed_precision
from kmp.core.loss_scale.arguments import ArgumentTypeError
from kmp.mixed_precision import experimental
from tests.support import backends
from tests.support.fuzzing import FUZZ
from tests.support.fuzzing import call_expecting_clean_error
from tests.support.fuzzing import junk
from tests.support.training import INF
from tests.support.training import NAN
from tests.support.training import assert_unchanged_by

# The same on every backend: CI runs it on TensorFlow only.
pytestmark = pytest.mark.anybackend

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1


class _LegacyOptimizer:
    """Looks like a tf_keras (Keras 2) optimizer, but is no Keras 3 one."""

    learning_rate = 0.01

    def apply_gradients(self, grads_and_vars):
        del grads_and_vars

    def get_config(self):
        return {"learning_rate": self.learning_rate}


@pytest.mark.parametrize(
    "inner",
    ["adam", None, _LegacyOptimizer()],
    ids=["string", "none", "tf_keras_like"],
)
def test_inner_must_be_a_keras_optimizer(inner):
    with pytest.raises(
        TypeError, match="'inner_optimizer' must be a Keras optimizer instance"
    ):
        LossScaleOptimizer(inner)
    if isinstance(inner, _LegacyOptimizer):
        # Keras 3.15 sets loss_scale_factor on whatever it is given.
        assert vars(inner) == {}


@pytest.mark.parametrize(
    "wrapper",
    [LossScaleOptimizer, keras.optimizers.LossScaleOptimizer],
    ids=["kmp", "keras"],
)
def test_inner_must_not_be_a_loss_scale_optimizer(wrapper):
    inner = wrapper(keras.optimizers.SGD(0.1))

    def construct():
        with pytest.raises(TypeError, match="must not be a LossScaleOptimizer"):
            LossScaleOptimizer(inner)

    assert_unchanged_by(inner, construct)


@pytest.mark.parametrize(
    "initial_scale",
    [-1, 0, 0.5, INF, NAN, 1e39],
    ids=["negative", "zero", "half", "inf", "nan", "above_float32_max"],
)
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
def test_initial_scale_must_be_finite_and_at_least_one(dynamic, initial_scale):
    inner = keras.optimizers.Adam(0.01)

    def construct():
        # A dynamic scale's floor is min_scale, 1 unless set.
        with pytest.raises(
            ValueError,
            match=r"'initial_scale' must be a finite number >= "
            r"(1|min_scale \(1\))",
        ):
            LossScaleOptimizer(
                inner, dynamic=dynamic, initial_scale=initial_scale
            )

    assert_unchanged_by(inner, construct)


@pytest.mark.parametrize("initial_scale", ["8", True], ids=["string", "bool"])
def test_initial_scale_must_be_a_number(initial_scale):
    inner = keras.optimizers.Adam(0.01)

    def construct():
        # The contract promises ValueError; Python's convention, TypeError.
        for error in (ValueError, TypeError):
            with pytest.raises(error, match="'initial_scale' must be a number"):
                LossScaleOptimizer(inner, initial_scale=initial_scale)

    assert_unchanged_by(inner, construct)


@pytest.mark.parametrize(
    "growth_steps, errors",
    [
        (0, (ValueError,)),
        (-1, (ValueError,)),
        (1.5, (ValueError, TypeError)),
        (True, (ValueError, TypeError)),
    ],
    ids=["zero", "negative", "float", "bool"],
)
def test_dynamic_growth_steps_must_be_a_positive_integer(growth_steps, errors):
    inner = keras.optimizers.Adam(0.01)

    def construct():
        for error in errors:
            with pytest.raises(
                error, match="'dynamic_growth_steps' must be a positive integer"
            ):
                LossScaleOptimizer(inner, dynamic_growth_steps=growth_steps)

    assert_unchanged_by(inner, construct)


def test_fixed_scale_requires_initial_scale():
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(
            ValueError, match="'initial_scale' is required when dynamic=False"
        ):
            LossScaleOptimizer(inner, dynamic=False)

    assert_unchanged_by(inner, construct)


def test_fixed_scale_rejects_dynamic_growth_steps():
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(ValueError, match="only to a dynamic loss scale"):
            LossScaleOptimizer(
                inner,
                dynamic=False,
                initial_scale=128,
                dynamic_growth_steps=100,
            )

    assert_unchanged_by(inner, construct)


def test_dynamic_must_be_a_bool():
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(TypeError, match="'dynamic' must be True or False"):
            LossScaleOptimizer(inner, dynamic="yes")

    assert_unchanged_by(inner, construct)


def test_inner_with_its_own_loss_scale_factor_is_rejected():
    inner = keras.optimizers.SGD(0.1, loss_scale_factor=128.0)

    def construct():
        with pytest.raises(ValueError, match="has its own loss_scale_factor"):
            LossScaleOptimizer(inner)

    assert_unchanged_by(inner, construct)
    assert inner.loss_scale_factor == 128.0


def test_dynamic_defaults():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    assert optimizer.dynamic is True
    assert optimizer.initial_scale == 2.0**15
    assert optimizer.dynamic_growth_steps == 2000
    assert float(optimizer.loss_scale) == 2.0**15
    assert int(optimizer.dynamic_counter) == 0


def test_fixed_scale_settings():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=128
    )
    assert optimizer.dynamic is False
    assert optimizer.initial_scale == 128.0
    assert optimizer.dynamic_growth_steps is None
    assert float(optimizer.loss_scale) == 128.0
    assert optimizer.dynamic_counter is None


def test_largest_float32_is_a_valid_initial_scale():
    largest = float(np.finfo(np.float32).max)
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=largest
    )
    assert float(optimizer.loss_scale) == largest


@pytest.mark.parametrize(
    "knob, value",
    [
        ("growth_factor", 4.0),
        ("backoff_factor", 0.25),
        ("min_scale", 2.0),
        ("max_scale", 2.0**20),
        ("hysteresis", 2),
    ],
)
def test_fixed_scale_rejects_the_dynamic_rules_settings(knob, value):
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(ValueError) as info:
            LossScaleOptimizer(
                inner, dynamic=False, initial_scale=128, **{knob: value}
            )
        assert f"'{knob}'" in str(info.value)
        assert f"{knob}={value!r}" in str(info.value)
        assert "only to a dynamic loss scale" in str(info.value)

    assert_unchanged_by(inner, construct)


# --- Numeric settings are the float32 values applied -------------------------


def _float32(value):
    return float(np.float32(value))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"initial_scale": np.float16(np.inf)}, "initial_scale"),
        ({"initial_scale": np.float16(np.inf), "dynamic": False}, None),
        ({"max_scale": np.float16(np.inf)}, "max_scale"),
        ({"growth_factor": np.float16(np.inf)}, "growth_factor"),
        ({"min_scale": np.float16(np.inf)}, "min_scale"),
    ],
    ids=["initial_scale", "fixed_initial_scale", "max_scale", "growth", "min"],
)
def test_float16_inf_is_refused(kwargs, name):
    """NumPy 2 compares np.float16(inf) with the largest float32 in float16,
    where it is inf too: the scale started, or grew, to inf."""
    inner = keras.optimizers.SGD(0.1)
    name = name or "initial_scale"

    def construct():
        with pytest.raises(ValueError) as info:
            LossScaleOptimizer(inner, **kwargs)
        assert f"'{name}' must be" in str(info.value)
        assert f"{name}=np.float16(inf)" in str(info.value)

    assert_unchanged_by(inner, construct)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"growth_factor": 1 + 1e-9}, "=1.000000001, which rounds to 1.0"),
        ({"backoff_factor": 1 - 1e-9}, "=0.999999999, which rounds to 1.0"),
        ({"min_scale": 1e-50}, "min_scale=1e-50, which rounds to 0"),
        ({"max_scale": 3.5e38}, "max_scale=3.5e+38, which overflows float32"),
        (
            {"initial_scale": 1e39, "dynamic": False},
            "initial_scale=1e+39, which overflows float32",
        ),
    ],
    ids=["growth_one", "backoff_one", "min_zero", "max_inf", "fixed_inf"],
)
def test_settings_that_float32_changes_are_refused(kwargs, fragment):
    """1 + 1e-9 is 1.0 in float32: the scale would never grow (a silent
    no-op); 1e-50 is 0, 3.5e38 is inf."""
    inner = keras.optimizers.SGD(0.1)

    def construct():
        with pytest.raises(ValueError) as info:
            LossScaleOptimizer(inner, **kwargs)
        assert fragment in str(info.value)

    assert_unchanged_by(inner, construct)


def test_settings_report_and_save_the_float32_values_applied():
    """Any real number is taken (Fractions, Decimals, every NumPy type) and
    kept as the float32 value applied: properties and get_config give plain
    Python numbers, which JSON holds and from_config gives back exactly."""
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=np.longdouble("1000.1"),
        dynamic_growth_steps=np.uint16(3),
        growth_factor=ml_dtypes.bfloat16(1.5),
        backoff_factor=fractions.Fraction(1, 3),
        min_scale=decimal.Decimal("0.7"),
        max_scale=np.float16(60000),
        hysteresis=np.int8(2),
        max_consecutive_skips=np.int64(5),
        record_nonfinite=np.bool_(True),
    )
    expected = {
        "initial_scale": _float32(1000.1),
        "dynamic_growth_steps": 3,
        "growth_factor": 1.5,
        "backoff_factor": _float32(1 / 3),
        "min_scale": _float32(0.7),
        "max_scale": 60000.0,
        "hysteresis": 2,
        "max_consecutive_skips": 5,
        "record_nonfinite": True,
    }
    config = optimizer.get_config()
    for name, value in expected.items():
        assert config[name] == value, name
        assert type(config[name]) is type(value), name
    assert optimizer.initial_scale == expected["initial_scale"]
    assert float(optimizer.loss_scale) == expected["initial_scale"]
    rule = optimizer.rule
    assert (rule.min_scale, rule.max_scale) == (_float32(0.7), 60000.0)
    assert json.loads(json.dumps(config)) == config
    restored = LossScaleOptimizer.from_config(config)
    assert restored.get_config() == config
    assert restored.rule == rule


@pytest.mark.parametrize(
    "value",
    [np.float16(np.inf), np.float64(1e39), np.float16(-np.inf), 1e-50],
    ids=["float16_inf", "beyond_float32", "float16_minus_inf", "to_zero"],
)
def test_learning_rate_that_float32_changes_is_refused(value):
    inner = keras.optimizers.SGD(0.25)
    optimizer = LossScaleOptimizer(inner)

    def assign():
        with pytest.raises(ValueError, match="'learning_rate' must be") as e:
            optimizer.learning_rate = value
        assert f"learning_rate={value!r}" in str(e.value)

    assert_unchanged_by(optimizer, assign)
    assert float(np.array(inner.learning_rate)) == 0.25


@pytest.mark.parametrize("attribute", ["learning_rate", "lr"])
@pytest.mark.parametrize(
    "value, error",
    [
        (NAN, ValueError),
        (1e39, ValueError),
        ("0.1", TypeError),
        (backends.tensor(INF), ValueError),
        (backends.tensor([0.1, 0.2]), ValueError),
        (backends.tensor(1, "int32"), TypeError),
    ],
    ids=["nan", "beyond_float32", "string", "inf_tensor", "vector", "int"],
)
def test_a_bad_learning_rate_is_refused_by_the_name_assigned(
    attribute, value, error
):
    # `optimizer.lr = ...` (Keras 2's alias) is refused as `lr`.
    inner = keras.optimizers.SGD(0.25)
    optimizer = LossScaleOptimizer(inner)

    def assign():
        with pytest.raises(error) as caught:
            setattr(optimizer, attribute, value)
        message = str(caught.value)
        assert f"'{attribute}' must be" in message
        assert f"Received: {attribute}=" in message
        if attribute == "lr":
            assert "learning_rate" not in message

    assert_unchanged_by(optimizer, assign)
    assert float(np.array(inner.learning_rate)) == 0.25


def _assigned(rate):
    inner = keras.optimizers.SGD(0.25)
    inner.learning_rate = rate  # Keras's own setter takes any value.
    return inner


@pytest.mark.parametrize(
    "make_inner, shown",
    [
        (lambda: keras.optimizers.SGD(1e39), "of value inf"),
        (lambda: keras.optimizers.Adam(-INF), "of value -inf"),
        (lambda: _assigned(NAN), "of value nan"),
        (lambda: _assigned(backends.tensor(INF)), "of value inf"),
    ],
    ids=["beyond_float32", "minus_inf", "nan_assigned", "inf_tensor"],
)
def test_inner_learning_rate_must_be_finite_in_float32(make_inner, shown):
    # Keras stores SGD(1e39)'s rate as inf: every step would be skipped.
    inner = make_inner()
    attributes = dict(vars(inner))  # Compared by identity first (NaN).
    with pytest.raises(ValueError) as caught:
        LossScaleOptimizer(inner)
    message = str(caught.value)
    assert "learning rate of 'inner_optimizer' must be a finite" in message
    assert "Received: inner_optimizer.learning_rate=" in message
    assert shown in message
    assert dict(vars(inner)) == attributes
    assert inner.loss_scale_factor is None


@pytest.mark.parametrize("kind", ["schedule", "callable"])
def test_inner_learning_rate_schedules_and_callables_are_left_alone(kind):
    # Their value can change at every step, where a non-finite one skips it.
    class Infinite(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return INF

    rate = Infinite() if kind == "schedule" else (lambda: INF)
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(rate))
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(backends.tensor([1.0]), variable)])
    assert int(optimizer.skipped_steps) == 1
    np.testing.assert_array_equal(np.array(variable), [1.0])


def test_legacy_names_pass_settings_through_the_same_door():
    assert mixed_precision.LossScaleOptimizer is LossScaleOptimizer
    with pytest.warns(experimental.LegacyAPIWarning):
        fixed = experimental.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), decimal.Decimal("1000.1")
        )
    assert fixed.dynamic is False
    assert fixed.initial_scale == _float32(1000.1)
    assert fixed.get_config()["initial_scale"] == _float32(1000.1)
    for value in (np.float16(np.inf), 1e39):
        with pytest.raises(ValueError, match="'initial_scale' must be"):
            with pytest.warns(experimental.LegacyAPIWarning):
                experimental.LossScaleOptimizer(keras.optimizers.SGD(), value)


def test_wrong_types_are_argument_type_errors():
    inner = keras.optimizers.SGD(0.1)
    for kwargs in ({"initial_scale": "8"}, {"dynamic_growth_steps": 2.5}):
        with pytest.raises(ArgumentTypeError) as info:
            LossScaleOptimizer(inner, **kwargs)
        assert isinstance(info.value, TypeError)
        assert isinstance(info.value, ValueError)


# --- Fuzzing ------------------------------------------------------------------


def _in_float32(value):
    """The float32 a number is applied as (inf beyond float32's range), or
    None for anything else."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        return None
    try:
        value = float(value)
    except OverflowError:
        return float("inf")
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _is_valid(argument, value) -> bool:
    """Whether the contract allows `value` for `argument` (all else default)."""
    is_int = isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )
    if argument == "dynamic":
        return isinstance(value, bool)
    if argument == "initial_scale":
        # Changed on purpose: checked as the float32 it is applied as (so
        # 1 - 1e-12, which is 1.0 in float32, is a valid scale).
        rounded = _in_float32(value)
        return rounded is not None and 1 <= rounded <= _FLOAT32_MAX
    if argument in ("dynamic_growth_steps", "max_consecutive_skips"):
        # Changed on purpose: at most 2**31 - 1 (was 2**63 - 1), as the
        # counters are int32 on JAX without x64.
        return is_int and 1 <= value <= _INT32_MAX
    if argument == "on_persistent_skips":
        return isinstance(value, str) and value in ("warn", "raise")
    if argument == "record_nonfinite":
        return isinstance(value, bool)
    if argument == "name":
        return isinstance(value, str) and "/" not in value
    raise AssertionError(argument)


@FUZZ
@given(
    argument=st.sampled_from(
        [
            "dynamic",
            "initial_scale",
            "dynamic_growth_steps",
            "max_consecutive_skips",
            "on_persistent_skips",
            "record_nonfinite",
            "name",
        ]
    ),
    value=junk() | st.integers(2**62, 2**66) | st.integers(2**30, 2**32),
)
@example(argument="max_consecutive_skips", value=2**64)
@example(argument="max_consecutive_skips", value=2**31)
@example(argument="max_consecutive_skips", value=2**31 - 1)
@example(argument="dynamic_growth_steps", value=2**63)
@example(argument="dynamic_growth_steps", value=2**31)
@example(argument="dynamic_growth_steps", value=2**31 - 1)
@example(argument="initial_scale", value=10**400)
@example(argument="name", value="a/b")
def test_loss_scale_optimizer_rejects_bad_arguments(argument, value):
    inner = keras.optimizers.SGD(0.25)
    inner_config = inner.get_config()
    if value is None and argument in (
        "initial_scale",
        "dynamic_growth_steps",
        "max_consecutive_skips",
        "name",
    ):
        return  # None means "the default" for these.
    kwargs = {argument: value}
    if argument == "dynamic" and value is False:
        kwargs["initial_scale"] = 8.0  # Required for a fixed scale.

    if _is_valid(argument, value):
        # Accepted at construction means usable: one real step must work.
        optimizer = kmp.LossScaleOptimizer(inner, **kwargs)
        variable = keras.Variable([1.0])
        optimizer.apply_gradients([(backends.tensor([1.0]), variable)])
        assert int(np.array(optimizer.iterations)) == 1
        return
    error = call_expecting_clean_error(
        lambda: kmp.LossScaleOptimizer(inner, **kwargs), value
    )
    assert error is not None, f"{argument}={value!r} was accepted"
    assert inner.get_config() == inner_config
    assert inner.loss_scale_factor is None


@FUZZ
@given(inner=junk())
def test_loss_scale_optimizer_rejects_non_optimizers(inner):
    error = call_expecting_clean_error(
        lambda: kmp.LossScaleOptimizer(inner), inner
    )
    assert isinstance(error, TypeError)


@pytest.mark.parametrize(
    "argument", ["dynamic_growth_steps", "max_consecutive_skips"]
)
def test_counts_beyond_int32_are_refused(argument):
    """The counters are int32 on JAX without x64: a larger count could not be
    compared with them, so it must be refused where the user passes it.
    (Changed on purpose: the bound was int64's.)"""
    inner = keras.optimizers.SGD(0.25)
    with pytest.raises(ValueError, match=str(2**31)) as info:
        kmp.LossScaleOptimizer(inner, **{argument: 2**31})
    assert f"at most {_INT32_MAX}" in str(info.value)
    optimizer = kmp.LossScaleOptimizer(inner, **{argument: _INT32_MAX})
    if argument == "dynamic_growth_steps":
        assert optimizer.dynamic_growth_steps == _INT32_MAX


def test_wrapping_a_loss_scale_optimizer_is_refused():
    wrapped = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    keras_wrapped = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1)
    )
    for inner in (wrapped, keras_wrapped):
        with pytest.raises(TypeError, match="must not be a LossScaleOptimizer"):
            kmp.LossScaleOptimizer(inner)


@FUZZ
@given(value=junk() | st.sampled_from([0.5, 2, np.float32(0.125)]))
def test_learning_rate_assignment_validates_and_changes_nothing(value):
    inner = keras.optimizers.SGD(0.25)
    optimizer = kmp.LossScaleOptimizer(inner, initial_scale=8.0)
    rounded = _in_float32(value)
    # Changed on purpose: a non-zero rate that is 0 in float32 is refused.
    valid = (
        rounded is not None
        and -_FLOAT32_MAX <= rounded <= _FLOAT32_MAX  # Not NaN, inf, 10**400.
        and (rounded != 0 or value == 0)
    )
    if valid:
        optimizer.learning_rate = value
        assert float(np.array(inner.learning_rate)) == np.float32(value)
        return

    def assign():
        optimizer.learning_rate = value

    error = call_expecting_clean_error(assign, value)
    assert error is not None, f"learning_rate={value!r} was accepted"
    assert float(np.array(inner.learning_rate)) == 0.25
    assert float(np.array(optimizer.learning_rate)) == 0.25
