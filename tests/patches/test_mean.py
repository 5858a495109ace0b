"""Tests for the `mean` patch: bfloat16 means without a float32 copy.

Each result is compared with Keras's own `mean` (the patch uninstalled):
outputs bit for bit; gradients bit for bit eagerly, and in a tf.function
against the correctly rounded gradient, which there is not Keras's. The
patch is off unless installed.
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
from keras.src.backend.tensorflow import numpy as keras_tf_numpy  # noqa: E402

import kmp  # noqa: E402
from kmp.patches import mean  # noqa: E402


def _is_installed():
    return "mean" in kmp.patches.installed()


def _set_installed(installed):
    # The autouse fixture in conftest.py puts the patches back afterwards.
    if installed:
        kmp.patches.install("mean")
    else:
        kmp.patches.uninstall("mean")


def _mean_and_gradient(x, installed, mode, **options):
    _set_installed(installed)

    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = keras.ops.mean(x, **options)
            # A weighted sum, so that every output gets its own gradient.
            weights = tf.reshape(
                tf.range(tf.size(y), dtype=tf.float32), tf.shape(y)
            )
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        return y, tape.gradient(loss, x)

    if mode == "tf_function":
        run = tf.function(run)
    y, grad = run(x)
    return y.numpy(), grad.numpy()


CASES = {
    "pool_2d_32x32": ((4, 32, 32, 8), {"axis": [1, 2]}),
    "pool_2d_7x7": ((4, 7, 7, 16), {"axis": (1, 2), "keepdims": True}),
    "sequence_100": ((4, 100, 8), {"axis": 1}),
    "negative_axis": ((4, 5, 48), {"axis": -1}),
    "all_axes": ((16, 16), {}),
    "large_sum": ((2, 256, 256), {"axis": [1, 2]}),
}


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_mean_is_bit_identical_to_keras(case, mode):
    shape, options = CASES[case]
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 2.0, size=shape).astype("float32")
    x = tf.cast(tf.constant(values), tf.bfloat16)
    expected = _mean_and_gradient(x, False, mode, **options)
    actual = _mean_and_gradient(x, True, mode, **options)
    assert actual[0].dtype == expected[0].dtype
    np.testing.assert_array_equal(actual[0], expected[0])
    np.testing.assert_array_equal(actual[1], expected[1])


def _gradient_of(x, upstream, mode, **options):
    def run(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = keras.ops.mean(x, **options)
        return tape.gradient(y, x, output_gradients=upstream)

    if mode != "eager":
        run = tf.function(run, jit_compile=mode == "jit")
    return run(x, upstream).numpy()


@pytest.mark.parametrize("mode", ["eager", "tf_function", "jit"])
@pytest.mark.parametrize(
    "shape, axis",
    [((4, 7, 7, 16), (1, 2)), ((2, 3, 49), -1), ((8, 10), None)],
    ids=["pool_7x7", "count_49", "all_60"],
)
def test_gradient_of_any_upstream_is_kerass(shape, axis, mode):
    # Upstream gradients with full bfloat16 mantissas: TensorFlow's own
    # bfloat16 gradient (kmp's before) differed from Keras's in a graph in
    # 833 of 3136 elements of the 7x7 pool, which integer upstream
    # gradients did not show.
    rng = np.random.default_rng(7)
    x = tf.cast(rng.normal(size=shape), tf.bfloat16)
    kept = np.mean(np.zeros(shape), axis=axis).shape
    upstream = tf.cast(rng.normal(size=kept) * 1.7, tf.bfloat16)
    _set_installed(False)
    expected = _gradient_of(x, upstream, mode, axis=axis)
    _set_installed(True)
    actual = _gradient_of(x, upstream, mode, axis=axis)
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(
        actual.view(np.uint16), expected.view(np.uint16)
    )


def _float32_casts(shape, dtype, **options):
    graph = (
        tf.function(lambda x: keras.ops.mean(x, **options))
        .get_concrete_function(tf.TensorSpec(shape, dtype))
        .graph
    )
    return [
        op
        for op in graph.get_operations()
        if op.type == "Cast" and op.outputs[0].dtype == tf.float32
    ]


def test_no_float32_copy_of_a_bfloat16_input():
    _set_installed(False)
    assert _float32_casts((4, 32, 32, 8), tf.bfloat16, axis=[1, 2])
    _set_installed(True)
    assert not _float32_casts((4, 32, 32, 8), tf.bfloat16, axis=[1, 2])


@pytest.mark.parametrize(
    "shape, dtype, options",
    [
        ((4, 257), tf.bfloat16, {"axis": 1}),  # 257 is not a bfloat16
        ((4, None), tf.bfloat16, {"axis": 1}),  # count unknown
        ((4, 32), tf.float16, {"axis": 1}),  # float16 can overflow
    ],
    ids=["count_not_representable", "unknown_count", "float16"],
)
def test_other_inputs_keep_keras_path(shape, dtype, options):
    _set_installed(True)
    assert _float32_casts(shape, dtype, **options)


@pytest.mark.parametrize("dtype", ["int32", "float32", "float64"])
def test_other_dtypes_give_kerass_results(dtype):
    x = tf.constant([[1, 2, 4], [3, 5, 8]], dtype)
    _set_installed(False)
    expected = keras.ops.mean(x, axis=1).numpy()
    _set_installed(True)
    actual = keras.ops.mean(x, axis=1).numpy()
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual, expected)


def test_global_average_pooling_under_mixed_bfloat16():
    x = tf.constant(
        np.random.default_rng(1).normal(size=(2, 8, 8, 4)), tf.float32
    )

    def run():
        with kmp.policy_scope("mixed_bfloat16"):
            layer = keras.layers.GlobalAveragePooling2D()
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
        return y.numpy(), tape.gradient(loss, x).numpy()

    _set_installed(False)
    expected = run()
    _set_installed(True)
    actual = run()
    assert actual[0].dtype == expected[0].dtype
    np.testing.assert_array_equal(actual[0], expected[0])
    np.testing.assert_array_equal(actual[1], expected[1])


def test_install_is_idempotent_and_uninstall_restores_keras():
    _set_installed(False)
    keras_mean = keras_tf_numpy.mean
    assert not hasattr(keras_mean, "__kmp_patch__")
    _set_installed(True)
    _set_installed(True)
    assert _is_installed()
    assert keras_tf_numpy.mean.__kmp_patch__ == "mean"
    assert keras_tf_numpy.mean.__kmp_original__ is keras_mean
    _set_installed(False)
    _set_installed(False)
    assert not _is_installed()
    assert keras_tf_numpy.mean is keras_mean


def test_importing_kmp_installs_it():
    assert _is_installed()
    info = {patch.name: patch for patch in kmp.patches.available()}["mean"]
    assert info.applicable and info.installed


@pytest.mark.parametrize(
    "count, exact",
    [
        (1, True),
        (255, True),
        (256, True),
        (257, False),
        (1024, True),
        (784, True),
        (1000, True),
        (1001, False),
        (49, True),
    ],
)
def test_exact_in_bfloat16(count, exact):
    assert mean.exact_in_bfloat16(count) is exact
    # Cross-check with TensorFlow's own rounding.
    rounded = float(tf.cast(tf.constant(float(count)), tf.bfloat16))
    assert (rounded == count) is exact
