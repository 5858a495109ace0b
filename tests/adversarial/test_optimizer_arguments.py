"""`LossScaleOptimizer` construction, setters and config, misused.

Every refusal is a TypeError or ValueError at the call, naming the value
given, with nothing changed: the inner optimizer (which a failed
construction must not mutate), the model and the optimizer's variables.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from tests.adversarial._support import LSO
from tests.adversarial._support import assert_bits_equal
from tests.adversarial._support import refused
from tests.adversarial._support import scale_of
from tests.adversarial._support import values

NAN = float("nan")
INF = float("inf")


def inner_state(inner):
    return (inner.get_config(), inner.built, values(inner))


@pytest.mark.parametrize(
    "inner",
    [
        "adam",
        keras.optimizers.SGD,
        None,
        object(),
        lambda: keras.optimizers.SGD(),
        tf.keras.optimizers.SGD if hasattr(tf, "keras") else None,
    ],
    ids=["string", "class", "none", "object", "factory", "tf_keras_class"],
)
def test_inner_optimizer_must_be_an_instance(inner):
    with pytest.raises(TypeError, match="inner_optimizer"):
        LSO(inner)


@pytest.mark.parametrize("kind", ["kmp", "keras"])
def test_loss_scale_optimizer_inside_refused(kind):
    plain = keras.optimizers.SGD(0.1)
    inner = (
        LSO(plain)
        if kind == "kmp"
        else keras.optimizers.LossScaleOptimizer(plain)
    )
    before = inner_state(plain)
    with pytest.raises(TypeError, match="LossScaleOptimizer"):
        LSO(inner)
    assert inner_state(plain)[:2] == before[:2]


def test_inner_with_loss_scale_factor_refused():
    inner = keras.optimizers.SGD(0.1, loss_scale_factor=128.0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        LSO(inner)
    assert inner.loss_scale_factor == 128.0


@pytest.mark.parametrize(
    "dynamic",
    ["dynamic", 1, 0, None, 1.0, np.True_],
    ids=["string", "one", "zero", "none", "float", "numpy_bool"],
)
def test_dynamic_must_be_a_bool(dynamic):
    with pytest.raises(TypeError, match="dynamic"):
        LSO(keras.optimizers.SGD(), dynamic)


BAD_SCALES = {
    "nan": NAN,
    "inf": INF,
    "minus_inf": -INF,
    "zero": 0,
    "half": 0.5,
    "below_one": 0.9999999,
    "negative": -8,
    "too_big": 1e39,
    "huge_int": 2**200,
    "numpy_nan": np.float32(NAN),
    "numpy_inf": np.float64(INF),
    "tensor": tf.constant(8.0),
    "nan_tensor": tf.constant(NAN),
    "variable": keras.Variable(8.0),
    "string": "8",
    "bool": True,
    "complex": 8 + 0j,
    "list": [8.0],
}


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("scale", list(BAD_SCALES), ids=list(BAD_SCALES))
def test_bad_initial_scale_is_a_value_error(scale, dynamic):
    """The contract: ValueError for an initial_scale that is not a finite
    number >= 1 (a wrong type may also be a TypeError)."""
    inner = keras.optimizers.SGD(0.1)
    before = inner_state(inner)
    with pytest.raises(ValueError, match="initial_scale"):
        LSO(inner, dynamic, BAD_SCALES[scale])
    assert inner_state(inner)[:2] == before[:2]


@pytest.mark.parametrize(
    "scale", [1, 1.0, np.float32(8), np.int64(64), 2**127, 3.0]
)
def test_good_initial_scales(scale):
    for dynamic in (True, False):
        optimizer = LSO(keras.optimizers.SGD(), dynamic, scale)
        assert scale_of(optimizer) == float(np.float32(scale))
        assert optimizer.initial_scale == float(scale)


def test_fixed_needs_initial_scale_and_no_growth_steps():
    with pytest.raises(ValueError, match="initial_scale"):
        LSO(keras.optimizers.SGD(), dynamic=False)
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
        LSO(keras.optimizers.SGD(), False, 8, 100)
    fixed = LSO(keras.optimizers.SGD(), False, 8)
    assert fixed.dynamic_growth_steps is None
    assert fixed.dynamic_counter is None


@pytest.mark.parametrize(
    "steps",
    [0, -1, 2.0, "10", True, tf.constant(10), 2**31, 2**64, NAN],
    ids=[
        "zero",
        "negative",
        "float",
        "string",
        "bool",
        "tensor",
        "too_big",
        "huge",
        "nan",
    ],
)
def test_bad_dynamic_growth_steps_is_a_value_error(steps):
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
        LSO(keras.optimizers.SGD(), dynamic_growth_steps=steps)


@pytest.mark.parametrize(
    "knob, value",
    [
        ("growth_factor", 1.0),
        ("growth_factor", 0.5),
        ("growth_factor", NAN),
        ("growth_factor", INF),
        ("growth_factor", tf.constant(2.0)),
        ("backoff_factor", 0.0),
        ("backoff_factor", 1.0),
        ("backoff_factor", NAN),
        ("backoff_factor", "0.5"),
        ("min_scale", 0.0),
        ("min_scale", -1.0),
        ("min_scale", NAN),
        ("min_scale", 2.0**-30),
        ("max_scale", INF),
        ("max_scale", NAN),
        ("max_scale", 0.5),
        ("hysteresis", 0),
        ("hysteresis", 1.5),
        ("hysteresis", True),
    ],
)
def test_bad_rule_settings(knob, value):
    with pytest.raises((TypeError, ValueError), match=knob):
        LSO(keras.optimizers.SGD(), **{knob: value})


@pytest.mark.parametrize(
    "settings",
    [
        {"initial_scale": 2.0, "min_scale": 4.0},
        {"initial_scale": 2.0**20, "max_scale": 2.0**10},
        {"min_scale": 2.0**10, "max_scale": 2.0**5},
    ],
    ids=["below_min", "above_max", "min_above_max"],
)
def test_initial_scale_outside_the_rules_range(settings):
    with pytest.raises(ValueError):
        LSO(keras.optimizers.SGD(), **settings)


@pytest.mark.parametrize(
    "knob", ["growth_factor", "backoff_factor", "min_scale", "hysteresis"]
)
def test_rule_settings_refused_when_fixed(knob):
    value = {"growth_factor": 3.0, "backoff_factor": 0.25}.get(knob, 2)
    with pytest.raises(ValueError, match=knob):
        LSO(keras.optimizers.SGD(), False, 8, **{knob: value})


@pytest.mark.parametrize(
    "settings",
    [
        {"max_consecutive_skips": 0},
        {"max_consecutive_skips": -1},
        {"max_consecutive_skips": 1.5},
        {"max_consecutive_skips": True},
        {"max_consecutive_skips": "10"},
        {"max_consecutive_skips": 2**31},
        {"on_persistent_skips": "Raise"},
        {"on_persistent_skips": None},
        {"on_persistent_skips": "error"},
        {"record_nonfinite": 1},
        {"record_nonfinite": "yes"},
        {"record_nonfinite": None},
    ],
    ids=lambda s: "-".join(f"{k}={v!r}" for k, v in s.items()),
)
def test_bad_skip_options(settings):
    (name,) = settings
    with pytest.raises((TypeError, ValueError), match=name):
        LSO(keras.optimizers.SGD(), **settings)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"clipnorm": 1.0}, ValueError),
        ({"global_clipnorm": 1.0}, ValueError),
        ({"use_ema": True}, ValueError),
        ({"weight_decay": 0.0}, ValueError),
        ({"gradient_accumulation_steps": 2}, ValueError),
        ({"learning_rate": 0.1}, TypeError),
        ({"loss_scale": "dynamic"}, TypeError),
        ({"initial_scal": 8}, TypeError),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_keras_optimizer_arguments_refused(kwargs, error):
    """Arguments meant for the inner optimizer: refused, naming where they
    go, not silently dropped."""
    with pytest.raises(error, match=next(iter(kwargs))):
        LSO(keras.optimizers.SGD(), **kwargs)


# --- The learning rate ---


def trained():
    variable = keras.Variable([1.0, 2.0])
    optimizer = LSO(keras.optimizers.SGD(0.5))
    optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
    return optimizer, variable


BAD_RATES = {
    "nan": NAN,
    "inf": INF,
    "minus_inf": -INF,
    "numpy_nan": np.float32(NAN),
    "float64_overflow": np.float64(1e39),
    "python_overflow": 1e39,
    "nan_tensor": tf.constant(NAN),
    "inf_float16_tensor": tf.constant(INF, tf.float16),
    "nan_float64_tensor": tf.constant(NAN, tf.float64),
    "nan_tf_variable": tf.Variable(NAN),
    "nan_keras_variable": keras.Variable(NAN),
    "vector_tensor": tf.constant([0.1, 0.2]),
    "int_tensor": tf.constant(1),
    "bool_tensor": tf.constant(True),
    "string": "0.1",
    "none": None,
    "bool": True,
    "list": [0.1],
    "numpy_vector": np.array([0.1, 0.2], "float32"),
}


@pytest.mark.parametrize("rate", list(BAD_RATES))
def test_bad_learning_rate_refused(rate):
    optimizer, variable = trained()
    with refused((TypeError, ValueError), "learning_rate", optimizer, variable):
        optimizer.learning_rate = BAD_RATES[rate]
    assert float(optimizer.learning_rate) == 0.5
    optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.0])


@pytest.mark.parametrize(
    "rate",
    [
        0.25,
        1,
        np.float32(0.25),
        np.float64(0.25),
        tf.constant(0.25),
        tf.constant(0.25, tf.float64),
        keras.Variable(0.25),
    ],
    ids=["float", "int", "np32", "np64", "tensor", "tensor64", "variable"],
)
def test_good_learning_rates(rate):
    optimizer, variable = trained()
    optimizer.learning_rate = rate
    assert float(optimizer.learning_rate) == float(rate)
    assert float(optimizer.inner_optimizer.learning_rate) == float(rate)
    optimizer.apply_gradients([(tf.constant([4.0, 4.0]), variable)])
    expected = np.float32([0.5, 1.5]) - np.float32(float(rate)) * 4
    np.testing.assert_array_equal(variable.numpy(), expected)


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("source", ["variable", "callable", "schedule"])
def test_learning_rate_that_turns_nan_later_skips_the_step(source, mode):
    """A learning rate can become NaN after it was accepted (a variable
    assigned later, a callable, a schedule): the step is skipped, no NaN
    reaches the weights."""
    rate = keras.Variable(0.5)
    optimizer, variable = trained()
    if source == "variable":
        optimizer.learning_rate = rate
    elif source == "callable":
        optimizer.learning_rate = lambda: rate.value
    else:

        class Schedule(keras.optimizers.schedules.LearningRateSchedule):
            def __call__(self, step):
                return rate.value

        inner = keras.optimizers.SGD(Schedule())
        optimizer = LSO(inner)
        optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
    rate.assign(NAN)

    def step():
        optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])

    before = values(variable, optimizer.inner_optimizer)
    (step if mode == "eager" else tf.function(step))()
    if source == "variable":
        # Keras copies a variable's value into its own learning rate.
        np.testing.assert_array_equal(variable.numpy(), [0.0, 1.0])
        return
    assert_bits_equal(values(variable, optimizer.inner_optimizer), before)
    assert int(optimizer.skipped_steps) == 1


def test_learning_rate_of_a_multi_optimizer():
    inner = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            default_optimizer=keras.optimizers.SGD(0.1)
        )
    )
    optimizer = LSO(inner)
    with pytest.raises(AttributeError, match="MultiOptimizer"):
        _ = optimizer.learning_rate
    with pytest.raises(AttributeError, match="MultiOptimizer"):
        optimizer.learning_rate = 0.5


# --- Config ---

SETTINGS = [
    {},
    {"dynamic": False, "initial_scale": 128},
    {"initial_scale": 64, "dynamic_growth_steps": 10},
    {
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "min_scale": 2.0**-10,
        "max_scale": 2.0**30,
        "hysteresis": 3,
        "max_consecutive_skips": None,
        "on_persistent_skips": "raise",
        "record_nonfinite": True,
    },
]


@pytest.mark.parametrize("settings", SETTINGS, ids=range(len(SETTINGS)))
def test_config_round_trips(settings):
    optimizer = LSO(keras.optimizers.Adam(0.01), name="lso", **settings)
    config = optimizer.get_config()
    again = LSO.from_config(config)
    assert again.get_config() == config
    restored = keras.optimizers.deserialize(
        keras.optimizers.serialize(optimizer)
    )
    assert type(restored) is LSO
    assert restored.get_config() == config
    for name in ("dynamic", "initial_scale", "dynamic_growth_steps"):
        assert getattr(restored, name) == getattr(optimizer, name)
    assert scale_of(restored) == scale_of(optimizer)


def test_config_of_keras_loss_scale_optimizer_loads():
    keras_optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=64, dynamic_growth_steps=10
    )
    optimizer = LSO.from_config(keras_optimizer.get_config())
    assert optimizer.dynamic
    assert (optimizer.initial_scale, optimizer.dynamic_growth_steps) == (64, 10)
    assert scale_of(optimizer) == 64.0


def config_with(**changes):
    config = LSO(keras.optimizers.SGD(0.1)).get_config()
    config.update(changes)
    return config


TAMPERED = {
    "nan_scale": config_with(initial_scale=NAN),
    "inf_scale": config_with(initial_scale=INF),
    "half_scale": config_with(initial_scale=0.5),
    "string_scale": config_with(initial_scale="8"),
    "zero_growth": config_with(dynamic_growth_steps=0),
    "float_growth": config_with(dynamic_growth_steps=2.5),
    "string_dynamic": config_with(dynamic="False"),
    "fixed_with_growth": config_with(dynamic=False),
    "unknown_key": config_with(initial_scal=8),
    "clipnorm": config_with(clipnorm=1.0),
    "nan_backoff": config_with(backoff_factor=NAN),
    "bad_skips": config_with(on_persistent_skips="sometimes"),
    "no_inner": {"name": "x", "initial_scale": 8},
    "inner_is_string": config_with(inner_optimizer="sgd"),
    "inner_is_lso": config_with(
        inner_optimizer=keras.optimizers.serialize(LSO(keras.optimizers.SGD()))
    ),
    "not_a_dict": [("inner_optimizer", None)],
    "none": None,
}


@pytest.mark.parametrize("name", list(TAMPERED), ids=list(TAMPERED))
def test_from_tampered_config(name):
    with pytest.raises((TypeError, ValueError)):
        LSO.from_config(TAMPERED[name])


# --- Properties ---


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_state_properties_are_snapshots(mode):
    variable = keras.Variable([1.0])
    optimizer = LSO(keras.optimizers.SGD(0.1), dynamic_growth_steps=1)

    def read_then_step():
        scale = optimizer.loss_scale
        counter = optimizer.dynamic_counter
        optimizer.apply_gradients([(tf.constant([1.0]), variable)])
        return scale, counter

    if mode == "tf_function":
        read_then_step = tf.function(read_then_step)
    scale, counter = read_then_step()
    assert float(scale) == 2.0**15 and int(counter) == 0
    assert scale.dtype == tf.float32 and scale.shape == ()
    assert scale_of(optimizer) == 2.0**16
    assert int(optimizer.iterations) == 1
    assert math.isfinite(scale_of(optimizer))


def test_scale_growth_stops_at_max_and_backoff_at_min():
    variable = keras.Variable([1.0])
    optimizer = LSO(
        keras.optimizers.SGD(0.1),
        initial_scale=2.0**127,
        dynamic_growth_steps=1,
    )
    optimizer.apply_gradients([(tf.constant([1.0]), variable)])
    assert scale_of(optimizer) == 2.0**127  # 2**128 is inf in float32.
    small = LSO(keras.optimizers.SGD(0.1), initial_scale=2.0)
    for expected in (1.0, 1.0):
        small.apply_gradients([(tf.constant([NAN]), variable)])
        assert scale_of(small) == expected
    assert int(small.skipped_steps) == 2
    assert int(small.iterations) == 0


def test_fixed_scale_never_changes_and_still_skips():
    variable = keras.Variable([1.0])
    optimizer = LSO(keras.optimizers.SGD(0.5), dynamic=False, initial_scale=8)
    optimizer.apply_gradients([(tf.constant([INF]), variable)])
    optimizer.apply_gradients([(tf.constant([1.0]), variable)])
    assert scale_of(optimizer) == 8.0
    np.testing.assert_array_equal(variable.numpy(), [0.5])
    assert int(optimizer.iterations) == 1
    assert kmp.mixed_precision.LossScaleOptimizer is LSO
