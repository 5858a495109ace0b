"""Tests for kmp.core.loss_scale.scaling through `LossScaleOptimizer`: scaling
the loss and unscaling the gradients (in float32, keeping each dtype), and the
exact finite check that decides whether a step is skipped.

Keras 3.15 scales a float16 loss in float16 before the optimizer is built
(where 3 * 2**15 is inf), and unscales in the gradient's dtype (where
1 / 2**25 is 0 in float16).
"""

import math

import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kmp
from kmp import LossScaleOptimizer
from kmp.core.loss_scale import scaling
from tests.support import backends
from tests.support import training
from tests.support.fuzzing import FUZZ
from tests.support.fuzzing import call_expecting_clean_error
from tests.support.fuzzing import junk
from tests.support.training import INF
from tests.support.training import MODES
from tests.support.training import NAN

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

# --- get_scaled_loss ----------------------------------------------------------


@pytest.mark.parametrize("dtype", backends.FLOAT_DTYPES)
def test_scaled_loss_keeps_the_loss_dtype_before_and_after_build(dtype):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    loss = backends.tensor(1.5, dtype)

    before_build = optimizer.get_scaled_loss(loss)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    after_build = optimizer.get_scaled_loss(loss)

    for scaled in (before_build, after_build):
        assert backends.dtype(scaled) == dtype
        assert float(scaled) == 1.5 * 2**15


def test_float16_loss_scales_the_same_before_and_after_build():
    # 3 * 2**15 is above the largest float16: Keras gives inf (float16)
    # before build and 98304 (float32) after; kmp keeps the loss's dtype.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    loss = backends.tensor(3.0, "float16")
    before_build = optimizer.get_scaled_loss(loss)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    after_build = optimizer.get_scaled_loss(loss)
    assert backends.dtype(before_build) == "float16"
    assert backends.dtype(after_build) == "float16"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(before_build),
        keras.ops.convert_to_numpy(after_build),
    )


def test_scaled_loss_of_a_python_float():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    scaled = optimizer.get_scaled_loss(0.5)
    assert backends.dtype(scaled) == "float32"
    assert float(scaled) == 4.0


@pytest.mark.parametrize(
    "loss, expected",
    [
        (np.array(0.5, "float32"), 4.0),
        ([0.5, 1.0], [4.0, 8.0]),
        (float("inf"), float("inf")),
        (float("nan"), float("nan")),
    ],
    ids=["numpy_array", "list", "inf", "nan"],
)
def test_scaled_loss_of_a_floating_value_convertible_to_a_tensor(
    loss, expected
):
    # A non-finite loss gives non-finite gradients: the step is skipped.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    scaled = optimizer.get_scaled_loss(loss)
    assert backends.dtype(scaled) == "float32"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(scaled), expected)


# On JAX: stateless_scale_loss, see tests/core/jax/test_step.py.
@pytest.mark.tensorflow
def test_scaled_loss_reads_the_current_scale_inside_tf_function():
    tf = backends.tensorflow()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    scaled_loss = tf.function(optimizer.get_scaled_loss)
    loss = tf.constant(1.0)
    assert float(scaled_loss(loss)) == 8.0
    # A skipped step halves the scale; the traced function must see it.
    optimizer.apply_gradients([(tf.constant([INF]), keras.Variable([1.0]))])
    assert float(scaled_loss(loss)) == 4.0


def test_callable_loss_gives_a_callable():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    scaled = optimizer.get_scaled_loss(lambda: backends.tensor(1.5))
    assert callable(scaled)
    assert float(scaled()) == 12.0


@pytest.mark.parametrize(
    "loss",
    [
        backends.tensor(3, "int32"),
        3,
        "loss",
    ],
    ids=["int_tensor", "int", "string"],
)
def test_scaled_loss_rejects_a_non_floating_loss(loss):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="'loss' must be"):
        optimizer.get_scaled_loss(loss)


# --- get_unscaled_gradients and apply_gradients -------------------------------


def test_unscaled_gradients_keep_each_dtype_and_none():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    given = {
        "float16": [8.0, 16.0],
        None: None,
        "bfloat16": [8.0, 24.0],
        "float32": [8.0, 4.0],
        "float64": [8.0, 2.0],
    }
    expected = [[1.0, 2.0], None, [1.0, 3.0], [1.0, 0.5], [1.0, 0.25]]
    if not backends.HAS_FLOAT64:
        del given["float64"]
        expected.pop()
    grads = tuple(
        None if dtype is None else backends.tensor(values, dtype)
        for dtype, values in given.items()
    )
    unscaled = optimizer.get_unscaled_gradients(grads)
    assert isinstance(unscaled, list)
    assert unscaled[1] is None
    for grad, result, values in zip(grads, unscaled, expected):
        if grad is None:
            continue
        assert backends.dtype(result) == backends.dtype(grad)
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(keras.ops.cast(result, "float32")),
            values,
        )


def test_unscaled_gradients_accept_a_generator():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4)
    unscaled = optimizer.get_unscaled_gradients(
        backends.tensor([v]) for v in (4.0, 8.0)
    )
    assert [float(g[0]) for g in unscaled] == [1.0, 2.0]


@pytest.mark.tensorflow
def test_unscaled_gradients_keep_indexed_slices():
    tf = backends.tensorflow()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    sparse = tf.IndexedSlices(
        values=tf.constant([[8.0, 16.0], [24.0, 32.0]]),
        indices=tf.constant([3, 1]),
        dense_shape=tf.constant([5, 2]),
    )
    (unscaled,) = optimizer.get_unscaled_gradients([sparse])
    assert isinstance(unscaled, tf.IndexedSlices)
    np.testing.assert_array_equal(
        np.array(unscaled.values), [[1.0, 2.0], [3.0, 4.0]]
    )
    np.testing.assert_array_equal(np.array(unscaled.indices), [3, 1])
    np.testing.assert_array_equal(np.array(unscaled.dense_shape), [5, 2])


def test_float16_gradients_unscale_with_a_scale_above_2_to_the_24():
    # 1 / 2**25 is 0 in float16: the division must not happen in float16.
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=2**25
    )
    grads = [backends.tensor([1024.0, 2048.0, 512.0], "float16")]
    (unscaled,) = optimizer.get_unscaled_gradients(grads)
    assert backends.dtype(unscaled) == "float16"
    unscaled = keras.ops.convert_to_numpy(unscaled)
    np.testing.assert_array_equal(
        unscaled, np.array([2.0**-15, 2.0**-14, 2.0**-16], "float16")
    )
    assert np.all(unscaled > 0)


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
def test_apply_gradients_leaves_a_variable_without_gradient_alone():
    used, unused = keras.Variable([1.0]), keras.Variable([2.0])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8)
    scaled_grads = backends.gradients(
        lambda: optimizer.get_scaled_loss(keras.ops.sum(used)), [used, unused]
    )
    grads = optimizer.get_unscaled_gradients(scaled_grads)
    if backends.JAX:  # jax.grad gives zeros, not None.
        assert not np.any(keras.ops.convert_to_numpy(grads[1]))
    else:
        assert grads[1] is None
    optimizer.apply_gradients(zip(grads, [used, unused]))
    used, unused = training.values([used, unused])
    assert (float(used[0]), float(unused[0])) == (0.5, 2.0)
    assert training.optimizer_state(optimizer) == (8.0, 1, 0, 1)


@pytest.mark.parametrize(
    "grads",
    [backends.tensor([1.0, 2.0]), 3],
    ids=["single_tensor", "int"],
)
def test_unscaled_gradients_need_a_list(grads):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="'grads' must be a list of gradients"):
        optimizer.get_unscaled_gradients(grads)


def test_unscaled_gradients_reject_integer_gradients():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match=r"'grads\[1\]' must be floating"):
        optimizer.get_unscaled_gradients(
            [backends.tensor(1.0), backends.tensor(2, "int32")]
        )


def test_unscaled_gradients_name_a_non_floating_value_as_given():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match=r"'grads\[1\]' .*grads\[1\]=False"):
        optimizer.get_unscaled_gradients([None, False])


def test_scaled_loss_names_a_keras_variable_of_the_wrong_dtype():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(
        TypeError,
        match="'loss' must be floating point.*a variable of dtype bool",
    ):
        optimizer.get_scaled_loss(keras.Variable(True, trainable=False))


# --- The finite check ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "gradients, finite",
    [
        ([[1.0, 2.0], [3.0]], True),
        ([[INF], [1.0]], False),
        ([[1.0, NAN], [3.0]], False),
        ([[INF], [-INF]], False),
        ([[INF, -INF], [1.0]], False),
        # Changed on purpose: finite values whose sum overflows used to count
        # as non-finite; the check is now exact, elementwise.
        ([[3e38, 3e38], [1.0]], True),
        ([[3e38], [3e38]], True),
        ([[-3e38, -3e38], [3e38, 3e38]], True),
        ([[3e38, 3e38], [NAN]], False),
    ],
    ids=[
        "finite",
        "inf",
        "nan",
        "inf_in_one_minus_inf_in_other",
        "inf_minus_inf",
        "sum_overflow",
        "elementwise_overflow",
        "sum_overflow_both_signs",
        "sum_overflow_and_nan",
    ],
)
@pytest.mark.parametrize(
    "check",
    [scaling.all_finite, scaling.all_finite_quick_sum_first],
    ids=["elementwise", "quick_sum_first"],
)
def test_all_finite_is_exact(gradients, finite, mode, check):
    grads = [backends.tensor(g) for g in gradients] + [None]
    checked = training.compiled(lambda: check(grads), mode)
    assert bool(checked()) is finite


def test_the_elementwise_check_groups_gradients_of_one_shape():
    # Each group is AND-ed elementwise: a bad element in any member counts.
    tensor = backends.tensor
    good = [tensor([[1.0, 2.0]]), tensor([[3.0, 4.0]]), tensor([5.0])]
    assert bool(scaling.all_finite(good))
    for position in range(3):
        grads = list(good)
        bad = [[1.0, NAN]] if position < 2 else [INF]
        grads[position] = tensor(bad)
        assert not bool(scaling.all_finite(grads))
        assert not bool(scaling.all_finite_quick_sum_first(grads))


@pytest.mark.parametrize(
    "dtype", [d for d in backends.FLOAT_DTYPES if d != "float32"]
)
def test_all_finite_in_every_floating_dtype(dtype):
    large = float(ml_dtypes.finfo(dtype).max)
    tensor = backends.tensor
    assert bool(scaling.all_finite([tensor([large, large], dtype)]))
    assert not bool(scaling.all_finite([tensor([large, INF], dtype)]))
    assert bool(scaling.all_finite([None]))
    if backends.TENSORFLOW:
        tf = backends.tensorflow()
        sparse = tf.IndexedSlices(
            tf.constant([[1.0, NAN]], dtype), tf.constant([0]), (2, 2)
        )
        assert not bool(scaling.all_finite([sparse]))


# --- Fuzzing get_scaled_loss / get_unscaled_gradients -------------------------


def _beyond_float32(value) -> bool:
    """A finite Python float too large for float32, which `get_scaled_loss`
    refuses (see the test after the next)."""
    return (
        isinstance(value, float)
        and math.isfinite(value)
        and abs(value) > float(np.finfo(np.float32).max)
    )


def _converts_to_floating(value) -> bool:
    try:
        tensor = keras.ops.convert_to_tensor(value)
    except Exception:  # noqa: BLE001 - each backend raises its own.
        return False
    floating = ("float16", "bfloat16", "float32", "float64")
    return backends.dtype(tensor) in floating


@pytest.fixture(scope="module")
def optimizer():
    return kmp.LossScaleOptimizer(keras.optimizers.SGD(0.25), initial_scale=8.0)


def _assert_scale_unchanged(optimizer):
    assert float(optimizer.loss_scale) == 8.0
    assert int(optimizer.dynamic_counter) == 0


@FUZZ
@given(loss=junk())
def test_get_scaled_loss_rejects_non_floating_losses(optimizer, loss):
    if _converts_to_floating(loss) and not _beyond_float32(loss):
        scaled = optimizer.get_scaled_loss(loss)
        # The backend's own product (TensorFlow flushes subnormals to zero).
        expected = keras.ops.convert_to_tensor(loss) * 8.0
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(scaled),
            keras.ops.convert_to_numpy(expected),
        )
    else:
        error = call_expecting_clean_error(
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
        junk(),
        st.lists(junk() | st.just(backends.tensor([1.0, 2.0])), max_size=3),
        st.dictionaries(
            st.text(max_size=3), st.just(backends.tensor(1.0)), min_size=1
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
        error = call_expecting_clean_error(
            lambda: optimizer.get_unscaled_gradients(grads), bad
        )
        assert error is not None
    _assert_scale_unchanged(optimizer)
