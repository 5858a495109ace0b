"""`kmp.core.low_bit.update`: one variable's update, on every backend."""

import keras
import numpy as np
from keras import ops

import kmp


def _weights(name):
    return keras.Variable(
        np.full((4, 4), 1.5, "float32"), dtype="float32", name=name
    )


def test_weight_decay_reaches_the_view_and_keeps_the_exclusions():
    # A zero gradient leaves AdamW's step at 0: what changes a weight is
    # its decay alone, w * (1 - rate * decay), taken on the float32 view.
    decayed, excluded = _weights("decayed"), _weights("excluded")
    inner = keras.optimizers.AdamW(learning_rate=0.5, weight_decay=0.1)
    inner.exclude_from_weight_decay(var_names=["excluded"])
    optimizer = kmp.LowPrecisionOptimizer(inner, slot_dtype="bfloat16")
    zeros = [ops.zeros((4, 4)), ops.zeros((4, 4))]
    optimizer.apply(zeros, [decayed, excluded])
    weight, decay, rate = np.float32(1.5), np.float32(0.1), np.float32(0.5)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(decayed),
        np.full((4, 4), weight - weight * decay * rate),
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(excluded), np.full((4, 4), 1.5)
    )


def test_a_bfloat16_weight_keeps_what_rounding_dropped():
    # Kahan summation: an update below half a bfloat16 ulp of the weight
    # is kept in the compensation, and the weight plus it is the float32
    # result.
    weight = keras.Variable(np.ones((4, 4), "float32"), dtype="bfloat16")
    inner = keras.optimizers.SGD(learning_rate=1.0)
    optimizer = kmp.LowPrecisionOptimizer(inner)
    optimizer.apply([ops.full((4, 4), 2.0**-10, "bfloat16")], [weight])
    (compensation,) = [
        v for v in optimizer.variables if "compensation" in v.path
    ]
    total = ops.convert_to_numpy(ops.cast(weight, "float32")) + (
        ops.convert_to_numpy(ops.cast(compensation, "float32"))
    )
    np.testing.assert_array_equal(total, np.full((4, 4), 1 - 2.0**-10))
    np.testing.assert_array_equal(
        ops.convert_to_numpy(ops.cast(weight, "float32")), np.ones((4, 4))
    )
