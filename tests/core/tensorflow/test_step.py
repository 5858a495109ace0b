"""Tests for kmp.core.tensorflow.step: how a step is applied on TensorFlow.

For Keras's own optimizers on small models in a tf.function, the inner update
is applied at once and the state read just before it is written back if the
step was not finite; otherwise the whole update runs inside a cond. Both must
give exactly what the inner optimizer alone gives, and skip exactly.
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

import kmp  # noqa: E402
from kmp import LossScaleOptimizer  # noqa: E402
from kmp.core.tensorflow import step as tf_step  # noqa: E402
from tests.support.training import INF  # noqa: E402
from tests.support.training import NAN  # noqa: E402


def test_skipped_update_is_restored_in_one_function_call():
    # On a small model the update is applied at once and a failed check
    # writes the old state back, in one `If` op kept out of TensorFlow's
    # lowering into Switch/Merge ops (one per tensor and variable it uses).
    optimizer = LossScaleOptimizer(keras.optimizers.Adam())
    variables = [keras.Variable(np.ones(3, "float32")) for _ in range(4)]
    grads = [tf.ones(3) for _ in variables]
    optimizer.build(variables)

    @tf.function
    def step():
        optimizer.apply_gradients(zip(grads, variables))

    graph = step.get_concrete_function().graph
    conds = [op for op in graph.get_operations() if op.type.endswith("If")]
    restore = [
        op for op in conds if op.get_attr("_lower_using_switch_merge") is False
    ]
    assert len(restore) == 1, [op.name for op in conds]
    # The persistent-skips report (a py_function) lives inside that If only:
    # in the step's own graph it slows every step.
    types = {op.type for op in graph.get_operations()}
    assert not types & {"EagerPyFunc", "PyFunc"}
    # The update itself is outside any cond: Adam's writes are in the graph.
    writes = [
        op
        for op in graph.get_operations()
        if op.type in ("AssignAddVariableOp", "AssignSubVariableOp")
    ]
    assert len(writes) >= 2 * len(variables)


# --- Applying the update before the check -----------------------------------
#
# For Keras's own optimizers on small models in a tf.function, kmp applies the
# inner update at once and writes the state read just before it back if the
# step was not finite; in every other case it runs the whole inner update
# inside the cond. Both must give exactly what the inner optimizer alone
# gives, and skip exactly.

INNER_OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "fused_adam": lambda: kmp.FusedAdam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adafactor": lambda: keras.optimizers.Adafactor(0.1),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adam_clipnorm_ema": lambda: keras.optimizers.Adam(
        0.01, clipnorm=0.5, use_ema=True
    ),
    "adam_ema_overwrite": lambda: keras.optimizers.Adam(
        0.01, use_ema=True, ema_overwrite_frequency=2
    ),
    "sgd_accumulation": lambda: keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=2
    ),
}
UPDATE_GRADIENTS = [
    [[0.5, -1.0, 2.0], [[0.25, 0.0], [-0.5, 1.0]]],
    [[0.1, 0.2, -0.3], [[1.0, -2.0], [0.5, 0.25]]],
    [[-1.0, 0.5, 0.5], [[0.0, 0.75], [-0.25, 0.5]]],
]


def _update_variables():
    # The second variable has a constraint, which `apply` also writes.
    return [
        keras.Variable([1.0, -2.0, 3.0], name="a"),
        keras.Variable(
            [[0.5, 1.5], [-1.0, 2.0]],
            name="b",
            constraint=keras.constraints.MaxNorm(2.0),
        ),
    ]


def _state(optimizer, variables):
    return [np.array(v) for v in [*variables, *optimizer.variables]]


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("apply_first", [True, False], ids=["first", "in_cond"])
@pytest.mark.parametrize("optimizer_name", list(INNER_OPTIMIZERS))
def test_update_matches_inner_optimizer_and_skips_exactly(
    optimizer_name, apply_first, mode, monkeypatch
):
    if not apply_first:
        monkeypatch.setattr(tf_step, "RESTORE_MAX_ELEMENTS", 0)
    plain = INNER_OPTIMIZERS[optimizer_name]()
    plain_variables = _update_variables()
    scaled = LossScaleOptimizer(
        INNER_OPTIMIZERS[optimizer_name](), initial_scale=1
    )
    scaled_variables = _update_variables()

    def stepper(optimizer, variables):
        def step(grads):
            optimizer.apply_gradients(zip(grads, variables))

        return tf.function(step) if mode == "tf_function" else step

    plain_step = stepper(plain, plain_variables)
    scaled_step = stepper(scaled, scaled_variables)
    for step, values in enumerate(UPDATE_GRADIENTS):
        grads = [tf.constant(g, "float32") for g in values]
        plain_step(grads)
        scaled_step(grads)
        expected = _state(plain, plain_variables)
        actual = _state(scaled.inner_optimizer, scaled_variables)
        for e, a in zip(expected, actual):
            np.testing.assert_array_equal(a, e, err_msg=f"step {step}")

    before = _state(scaled.inner_optimizer, scaled_variables)
    bad = [tf.constant(UPDATE_GRADIENTS[0][0], "float32")]
    bad.append(tf.constant([[1.0, NAN], [0.0, 1.0]], "float32"))
    scaled_step(bad)
    assert int(scaled.skipped_steps) == 1
    for b, a in zip(before, _state(scaled.inner_optimizer, scaled_variables)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_apply_first_handles_variables_of_any_float_dtype(dtype):
    # Variables stored in float16 (policy "float16"), bfloat16 or float64:
    # the snapshot and the check follow each dtype.
    def variables():
        return [
            keras.Variable(np.array([1.0, -2.0, 3.0]), dtype=dtype),
            keras.Variable(np.array([0.5, 0.25, 2.0]), dtype=dtype),
            keras.Variable(np.array([[1.0, 2.0]]), dtype=dtype),
        ]

    plain, plain_variables = (
        keras.optimizers.SGD(0.5, momentum=0.9),
        variables(),
    )
    scaled = LossScaleOptimizer(
        keras.optimizers.SGD(0.5, momentum=0.9), initial_scale=1
    )
    scaled_variables = variables()
    grads = [
        tf.constant([0.5, -1.0, 2.0], dtype),
        tf.constant([0.25, 0.5, 1.0], dtype),
        tf.constant([[1.0, -1.0]], dtype),
    ]
    plain_step = tf.function(
        lambda g: plain.apply_gradients(zip(g, plain_variables))
    )
    scaled_step = tf.function(
        lambda g: scaled.apply_gradients(zip(g, scaled_variables))
    )
    for _ in range(2):
        plain_step(grads)
        scaled_step(grads)
    expected = _state(plain, plain_variables)
    actual = _state(scaled.inner_optimizer, scaled_variables)
    for e, a in zip(expected, actual):
        np.testing.assert_array_equal(a, e)
    bad = list(grads)
    bad[1] = tf.constant([0.25, INF, 1.0], dtype)
    scaled_step(bad)
    assert int(scaled.skipped_steps) == 1
    after = _state(scaled.inner_optimizer, scaled_variables)
    for a, b in zip(actual, after):
        np.testing.assert_array_equal(b, a)


def test_which_updates_are_applied_before_the_check():
    # What kmp.core.tensorflow.step.apply passes: Keras's own optimizers and
    # kmp.FusedAdam.
    restorable = tf_step.restorable_types(extra=(kmp.FusedAdam,))

    def decide(inner, grads, variables):
        return tf_step.can_apply_then_restore(
            inner, grads, variables, restorable
        )

    def can(inner, grads, variables, eager=False):
        if eager:
            return decide(inner, grads, variables)
        answers = []

        @tf.function
        def trace():
            answers.append(decide(inner, grads, variables))

        trace.get_concrete_function()
        return answers[0]

    small = [keras.Variable(np.ones((4, 4), "float32"))]
    dense = [tf.ones((4, 4))]
    for name in INNER_OPTIMIZERS:
        assert can(INNER_OPTIMIZERS[name](), dense, small), name
    assert not can(keras.optimizers.Adam(), dense, small, eager=True)

    class MyAdam(keras.optimizers.Adam):
        pass

    assert not can(MyAdam(), dense, small)  # it may keep state elsewhere
    sparse = [tf.IndexedSlices(tf.ones((1, 4)), tf.constant([0]), (4, 4))]
    assert not can(keras.optimizers.Adam(), sparse, small)
    assert not can(
        keras.optimizers.Adam(), dense, [tf.Variable(tf.ones((4, 4)))]
    )
    large = [keras.Variable(np.zeros((2049, 2048), "float32"))]
    assert not can(keras.optimizers.Adam(), [tf.zeros((2049, 2048))], large)
    # Few variables of 64K elements on average: waiting costs less.
    few = [keras.Variable(np.zeros((256, 256), "float32")) for _ in range(2)]
    assert not can(keras.optimizers.Adam(), [tf.zeros((256, 256))] * 2, few)
    # Many small ones, 2K elements on average: applied first.
    many = [keras.Variable(np.zeros((64, 64), "float32")) for _ in range(20)]
    many += [keras.Variable(np.zeros((64,), "float32")) for _ in range(20)]
    assert can(keras.optimizers.Adam(), [tf.zeros(v.shape) for v in many], many)


@pytest.mark.parametrize("record", [False, True], ids=["flags", "per_gradient"])
def test_true_on_every_replica_ands_each_flag_across_replicas(
    two_replicas, record
):
    """For gradients the caller summed: a flag false on one replica is
    false on all, so that all skip together."""

    def replica_step():
        index = tf.distribute.get_replica_context().replica_id_in_sync_group
        finite = tf.not_equal(index, 1)
        per_gradient = [tf.constant(True), tf.equal(index, 0)]
        finite, apply_ok, per_gradient = tf_step.true_on_every_replica(
            finite, tf.constant(True), per_gradient if record else None
        )
        if not record:
            assert per_gradient is None
            return tf.stack([finite, apply_ok])
        return tf.stack([finite, apply_ok, *per_gradient])

    results = two_replicas.experimental_local_results(
        two_replicas.run(tf.function(replica_step))
    )
    expected = [False, True, True, False] if record else [False, True]
    assert [r.numpy().tolist() for r in results] == [expected, expected]
