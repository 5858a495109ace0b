"""Fuzzing the public surface: bad input gets a clean, named, harmless error.

Every public function and constructor is called with hypothesis-generated
wrong types, wrong values, non-finite and huge numbers and wrong nesting. The
only exceptions allowed are TypeError and ValueError, each message naming the
bad value, and a call that raised changes nothing: the global policy, the
inner optimizer's config, the scale and the learning rate are as before.
Also: `.keras` files holding kmp objects load under `safe_mode=True`, and
safe mode refuses to run code stored in such a file.
"""

import json
import math
import re
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import kmp
from kmp.policy import POLICY_NAMES

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = 2**63 - 1

FUZZ = settings(max_examples=40, deadline=None, derandomize=True)


def _junk():
    """Values of every kind a user might pass by mistake."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([1e300, -1e300, 10**400, math.nan, -math.inf]),
        st.text(max_size=8),
        st.binary(max_size=4),
        st.sampled_from([np.float64(math.inf), np.int64(-3), np.float32(0.5)]),
        st.builds(object),
    )
    return st.one_of(
        scalars,
        st.lists(scalars, max_size=3),
        st.tuples(scalars, scalars),
        st.dictionaries(st.text(max_size=4), scalars, max_size=2),
        st.lists(st.lists(scalars, max_size=2), max_size=2),
    )


def _names(message: str, value) -> bool:
    """Whether an error message names `value`.

    A tensor or array is named by its dtype (it may be huge); anything else
    by its repr, or a non-empty string by `=value` as Keras writes it.
    """
    if isinstance(value, (tf.Tensor, np.ndarray)):
        return tf.as_dtype(value.dtype).name in message
    if isinstance(value, str) and value and f"={value}" in message:
        return True
    # Long reprs may be shortened in the message: the start must be there.
    # Keras's attribute tracking shows lists without their ListWrapper.
    text = re.sub(r"ListWrapper\((.*?)\)", r"\1", repr(value))
    return repr(value)[:60] in message or text[:60] in message


def _call_expecting_clean_error(call, value):
    """Calls `call()`; if it raises, checks the error is a clean one.

    Returns the exception, or None when the call succeeded.
    """
    try:
        call()
    except (TypeError, ValueError) as error:
        assert _names(str(error), value), (
            f"{type(error).__name__} does not name the bad value "
            f"{value!r}: {error}"
        )
        return error
    except Exception as error:  # noqa: BLE001 - the point of the test.
        pytest.fail(
            f"{type(error).__name__} (not TypeError/ValueError) for "
            f"{value!r}: {error}"
        )
    return None


# --- Policies -----------------------------------------------------------------


@FUZZ
@given(name=_junk().filter(lambda v: not isinstance(v, str)) | st.text())
def test_policy_rejects_anything_but_a_policy_name(name):
    if isinstance(name, str) and name in POLICY_NAMES:
        assert kmp.Policy(name).name == name
        return
    error = _call_expecting_clean_error(lambda: kmp.Policy(name), name)
    assert error is not None
    assert isinstance(error, ValueError if isinstance(name, str) else TypeError)
    assert "mixed_float16" in str(error)  # It lists what is allowed.


@FUZZ
@given(
    start=st.sampled_from(POLICY_NAMES),
    config=st.one_of(
        _junk(),
        st.dictionaries(
            st.sampled_from(["name", "Name", "config", "dtype"]),
            _junk() | st.sampled_from(POLICY_NAMES),
            max_size=3,
        ),
    ),
)
def test_policy_from_config_rejects_bad_configs(start, config):
    kmp.set_global_policy(start)
    valid = (
        isinstance(config, dict)
        and set(config) == {"name"}
        and isinstance(config["name"], str)
        and config["name"] in POLICY_NAMES
    )
    if valid:
        assert kmp.Policy.from_config(config).name == config["name"]
    else:
        bad = config
        if isinstance(config, dict) and set(config) == {"name"}:
            bad = config["name"]
        error = _call_expecting_clean_error(
            lambda: kmp.Policy.from_config(config), bad
        )
        assert error is not None
    assert kmp.global_policy().name == start


@FUZZ
@given(
    start=st.sampled_from(POLICY_NAMES),
    policy=_junk().filter(lambda v: v is not None),
)
def test_set_global_policy_rejects_bad_policies_and_changes_nothing(
    start, policy
):
    kmp.set_global_policy(start)
    if isinstance(policy, str) and policy in POLICY_NAMES:
        return
    error = _call_expecting_clean_error(
        lambda: kmp.set_global_policy(policy), policy
    )
    assert error is not None
    assert kmp.global_policy().name == start
    assert keras.config.dtype_policy().name == start


@FUZZ
@given(
    outer=st.sampled_from(POLICY_NAMES),
    inner=_junk().filter(lambda v: v is not None),
)
def test_policy_scope_rejects_bad_policies_and_changes_nothing(outer, inner):
    if isinstance(inner, str) and inner in POLICY_NAMES:
        return

    def enter_bad_scope():
        with kmp.policy_scope(inner):
            pytest.fail("the block of a bad policy_scope ran")

    with kmp.policy_scope(outer):
        error = _call_expecting_clean_error(enter_bad_scope, inner)
        assert error is not None
        assert kmp.global_policy().name == outer
    assert kmp.global_policy().name == "float32"


def test_policy_scope_restores_after_the_block_raises_value_error():
    with pytest.raises(ValueError, match="inside"):
        with kmp.policy_scope("mixed_float16"):
            raise ValueError("inside")
    assert kmp.global_policy().name == "float32"


# --- LossScaleOptimizer(...) --------------------------------------------------


def _is_valid(argument, value) -> bool:
    """Whether the contract allows `value` for `argument` (all else default)."""
    is_int = isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )
    if argument == "dynamic":
        return isinstance(value, bool)
    if argument == "initial_scale":
        return (
            isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_))
            and 1 <= value <= _FLOAT32_MAX  # False for NaN, inf, 10**400.
        )
    if argument in ("dynamic_growth_steps", "max_consecutive_skips"):
        return is_int and 1 <= value <= 2**63 - 1  # The counters are int64.
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
    value=_junk() | st.integers(2**62, 2**66),
)
@example(argument="max_consecutive_skips", value=2**64)
@example(argument="dynamic_growth_steps", value=2**63)
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
        optimizer.apply_gradients([(tf.constant([1.0]), variable)])
        assert int(np.array(optimizer.iterations)) == 1
        return
    error = _call_expecting_clean_error(
        lambda: kmp.LossScaleOptimizer(inner, **kwargs), value
    )
    assert error is not None, f"{argument}={value!r} was accepted"
    assert inner.get_config() == inner_config
    assert inner.loss_scale_factor is None


@FUZZ
@given(inner=_junk())
def test_loss_scale_optimizer_rejects_non_optimizers(inner):
    error = _call_expecting_clean_error(
        lambda: kmp.LossScaleOptimizer(inner), inner
    )
    assert isinstance(error, TypeError)


def test_loss_scale_optimizer_rejects_growth_steps_beyond_int64():
    """The counter is an int64 variable: a larger dynamic_growth_steps cannot
    be compared with it, so it must be refused where the user passes it."""
    inner = keras.optimizers.SGD(0.25)
    with pytest.raises(ValueError, match=str(2**63)):
        kmp.LossScaleOptimizer(inner, dynamic_growth_steps=2**63)


def test_wrapping_a_loss_scale_optimizer_is_refused():
    wrapped = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    keras_wrapped = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1)
    )
    for inner in (wrapped, keras_wrapped):
        with pytest.raises(TypeError, match="must not be a LossScaleOptimizer"):
            kmp.LossScaleOptimizer(inner)


# --- get_scaled_loss / get_unscaled_gradients ---------------------------------


def _converts_to_floating(value) -> bool:
    try:
        return tf.convert_to_tensor(value).dtype.is_floating
    except (TypeError, ValueError):
        return False


@pytest.fixture(scope="module")
def optimizer():
    return kmp.LossScaleOptimizer(keras.optimizers.SGD(0.25), initial_scale=8.0)


def _assert_scale_unchanged(optimizer):
    assert float(optimizer.loss_scale) == 8.0
    assert int(optimizer.dynamic_counter) == 0


@FUZZ
@given(loss=_junk())
def test_get_scaled_loss_rejects_non_floating_losses(optimizer, loss):
    if _converts_to_floating(loss):
        scaled = optimizer.get_scaled_loss(loss)
        expected = np.asarray(tf.convert_to_tensor(loss)) * 8.0
        np.testing.assert_array_equal(np.asarray(scaled), expected)
    else:
        error = _call_expecting_clean_error(
            lambda: optimizer.get_scaled_loss(loss), loss
        )
        assert error is not None
    _assert_scale_unchanged(optimizer)


@pytest.mark.parametrize("loss", [1e300, -1e300], ids=["huge", "huge_neg"])
def test_get_scaled_loss_of_a_float_beyond_float32(optimizer, loss):
    """1e300 is a floating number, so not a TypeError: either it becomes a
    non-finite float32 loss (and the step is skipped) or a ValueError says it
    is out of float32's range."""
    try:
        scaled = optimizer.get_scaled_loss(loss)
    except ValueError as error:
        assert repr(loss) in str(error)
    else:
        assert not np.isfinite(np.asarray(scaled))


@FUZZ
@given(
    grads=st.one_of(
        _junk(),
        st.lists(_junk() | st.just(tf.constant([1.0, 2.0])), max_size=3),
        st.dictionaries(
            st.text(max_size=3), st.just(tf.constant(1.0)), min_size=1
        ),
    )
)
def test_get_unscaled_gradients_rejects_bad_nesting(optimizer, grads):
    is_list = isinstance(grads, (list, tuple))
    if is_list and all(g is None or _converts_to_floating(g) for g in grads):
        unscaled = optimizer.get_unscaled_gradients(grads)
        assert len(unscaled) == len(grads)
    else:
        bad = grads
        if is_list:
            bad = next(
                g
                for g in grads
                if g is not None and not _converts_to_floating(g)
            )
        error = _call_expecting_clean_error(
            lambda: optimizer.get_unscaled_gradients(grads), bad
        )
        assert error is not None
    _assert_scale_unchanged(optimizer)


# --- learning_rate assignment -------------------------------------------------


@FUZZ
@given(value=_junk() | st.sampled_from([0.5, 2, np.float32(0.125)]))
def test_learning_rate_assignment_validates_and_changes_nothing(value):
    inner = keras.optimizers.SGD(0.25)
    optimizer = kmp.LossScaleOptimizer(inner, initial_scale=8.0)
    valid = (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, (bool, np.bool_))
        and -_FLOAT32_MAX <= value <= _FLOAT32_MAX  # Not NaN, inf, 10**400.
    )
    if valid:
        optimizer.learning_rate = value
        assert float(np.array(inner.learning_rate)) == np.float32(value)
        return

    def assign():
        optimizer.learning_rate = value

    error = _call_expecting_clean_error(assign, value)
    assert error is not None, f"learning_rate={value!r} was accepted"
    assert float(np.array(inner.learning_rate)) == 0.25
    assert float(np.array(optimizer.learning_rate)) == 0.25


# --- safe_mode ----------------------------------------------------------------


def _kmp_model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, dtype=kmp.Policy("mixed_float16")),
            keras.layers.Dense(1, dtype=kmp.Policy("float32")),
        ]
    )
    model.compile(
        optimizer=kmp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64.0,
            dynamic_growth_steps=7,
        ),
        loss="mse",
    )
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    return model


def test_kmp_objects_load_under_safe_mode(tmp_path):
    model = _kmp_model()
    path = str(tmp_path / "kmp.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert float(loaded.optimizer.loss_scale) == float(
        model.optimizer.loss_scale
    )
    assert [layer.dtype_policy.name for layer in loaded.layers] == [
        "mixed_float16",
        "float32",
    ]


def _lambda_writing(marker):
    # Built from source so that its bytecode carries the marker path.
    source = (
        "lambda x: (__import__('pathlib').Path("
        f"{str(marker)!r}).write_text('ran'), x)[1]"
    )
    return eval(source)  # noqa: S307 - test code, our own string.


def test_safe_mode_runs_no_code_from_a_file_with_kmp_objects(tmp_path):
    marker = tmp_path / "code_ran.txt"
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Lambda(_lambda_writing(marker)),
            keras.layers.Dense(1, dtype=kmp.Policy("mixed_float16")),
        ]
    )
    model.compile(
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss="mse",
    )
    path = str(tmp_path / "lambda.keras")
    model.save(path)
    marker.unlink(missing_ok=True)  # Building the model ran it once.

    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(path, safe_mode=True)
    assert not marker.exists()
    # The control: without safe mode the stored code does run on load.
    keras.saving.load_model(path, safe_mode=False)
    assert marker.read_text() == "ran"


def test_safe_mode_refuses_a_lambda_hidden_in_the_kmp_optimizer(tmp_path):
    """A crafted file whose kmp optimizer config carries a serialized lambda
    (as the inner optimizer's learning rate) is refused too: kmp's
    from_config deserializes its inner optimizer inside Keras's safe mode."""
    marker = tmp_path / "code_ran.txt"
    model = _kmp_model()
    path = tmp_path / "kmp.keras"
    model.save(str(path))
    # Keras's own serialized form of a lambda: marshalled bytecode.
    layer = keras.layers.Lambda(_lambda_writing(marker))
    lambda_config = layer.get_config()["function"]
    assert lambda_config["class_name"] == "__lambda__"
    crafted = tmp_path / "crafted.keras"
    with (
        zipfile.ZipFile(path) as source,
        zipfile.ZipFile(crafted, "w") as target,
    ):
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                optimizer = config["compile_config"]["optimizer"]
                inner = optimizer["config"]["inner_optimizer"]
                inner["config"]["learning_rate"] = lambda_config
                data = json.dumps(config).encode()
            target.writestr(item, data)

    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(str(crafted), safe_mode=True)
    assert not marker.exists()
