"""Tests for kmp.tools.testing: GradientFaults and OverflowAt."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.tools.testing import GradientFaults
from kmp.tools.testing import OverflowAt


def _grads():
    return [
        tf.constant([1.0, 2.0]),
        None,
        tf.IndexedSlices(
            tf.constant([[3.0, 4.0]]), tf.constant([1]), tf.constant([3, 2])
        ),
        tf.constant(5.0, tf.float16),
    ]


def _values(gradient):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    return np.array(gradient).tolist()


@pytest.mark.parametrize("mode", ["eager", "tf_function", "jit"])
def test_gradient_faults_hit_only_the_scheduled_step_and_gradients(mode):
    faults = GradientFaults({2: ("inf", [0, 3]), 4: ("nan", [2])})

    def run(step):
        return faults(_grads(), step)

    if mode == "tf_function":
        run = tf.function(run)
    elif mode == "jit":
        # XLA cannot take IndexedSlices or None: dense gradients only.
        dense = GradientFaults({2: ("inf", [0])})
        run_jit = tf.function(
            lambda step: dense([tf.constant([1.0, 2.0])], step),
            jit_compile=True,
        )
        assert np.array(run_jit(tf.constant(1))[0]).tolist() == [1.0, 2.0]
        assert np.array(run_jit(tf.constant(2))[0]).tolist() == [np.inf, 2.0]
        return
    clean = [_values(g) for g in _grads()]
    for step in (0, 1, 3, 5):
        assert [_values(g) for g in run(tf.constant(step))] == clean
    at_2 = [_values(g) for g in run(tf.constant(2, tf.int64))]
    assert at_2 == [[np.inf, 2.0], None, [[3.0, 4.0]], np.inf]
    at_4 = run(tf.constant(4))
    assert np.isnan(_values(at_4[2])[0][0])
    assert _values(at_4[2])[0][1] == 4.0
    assert isinstance(at_4[2], tf.IndexedSlices)
    assert at_4[3].dtype == tf.float16


def test_gradient_faults_on_one_replica_only(two_replicas):
    faults = GradientFaults({0: ("inf", [0])}, replica=1)

    @tf.function
    def run():
        return two_replicas.run(lambda: faults([tf.constant([1.0])], 0)[0])

    per_replica = two_replicas.experimental_local_results(run())
    assert [np.array(v).tolist() for v in per_replica] == [[1.0], [np.inf]]


def test_gradient_faults_for_one_replica_need_a_replica_context(
    two_replicas,
):
    faults = GradientFaults({0: ("inf", [0])}, replica=1)
    with two_replicas.scope():
        with pytest.raises(ValueError, match="replica context"):
            faults([tf.constant([1.0])], 0)


@pytest.mark.parametrize(
    "schedule, replica, error, match",
    [
        ([1, 2], None, TypeError, "'schedule' must be a dict"),
        ({"1": ("inf", [0])}, None, TypeError, "Received: schedule step='1'"),
        ({-1: ("inf", [0])}, None, ValueError, "schedule step=-1"),
        ({True: ("inf", [0])}, None, TypeError, "schedule step=True"),
        ({1: "inf"}, None, TypeError, "pair \\(kind"),
        ({1: ("overflow", [0])}, None, ValueError, "'overflow' at step 1"),
        ({1: ("nan", 0)}, None, TypeError, "Received: 0 at step 1"),
        ({1: ("nan", "0")}, None, TypeError, "Received: '0' at step 1"),
        ({1: ("nan", [0.5])}, None, TypeError, "gradient index=0.5"),
        ({1: ("inf", [])}, None, ValueError, "non-empty.*\\[\\] at step 1"),
        ({1: ("inf", {0: 1})}, None, TypeError, "\\{0: 1\\} at step 1"),
        ({}, -1, ValueError, "replica=-1"),
        ({}, "1", TypeError, "replica='1'"),
    ],
    ids=[
        "list",
        "str_step",
        "negative_step",
        "bool_step",
        "not_a_pair",
        "unknown_kind",
        "int_indices",
        "str_indices",
        "float_index",
        "empty_indices",
        "dict_indices",
        "negative_replica",
        "str_replica",
    ],
)
def test_gradient_faults_validate_arguments(schedule, replica, error, match):
    with pytest.raises(error, match=match):
        GradientFaults(schedule, replica=replica)


def test_gradient_faults_take_indices_as_list_tuple_or_set():
    faults = GradientFaults({1: ("inf", (0, 2)), 2: ("nan", {1})})
    assert faults.schedule == {1: ("inf", (0, 2)), 2: ("nan", (1,))}


@pytest.mark.parametrize(
    "step, error, match",
    [
        ("1", TypeError, "'step' must be an integer scalar.*step='1'"),
        (None, TypeError, "step=None"),
        (True, TypeError, "step=True"),
        (1.5, TypeError, "step=1.5"),
        (tf.constant(1.7), TypeError, "step=<tf.Tensor.*float32"),
        ([1], TypeError, "step=\\[1\\]"),
        (tf.constant([0, 1]), TypeError, "step=<tf.Tensor.*shape=\\(2,\\)"),
        (-1, ValueError, "step=-1"),
    ],
    ids=[
        "str",
        "none",
        "bool",
        "float",
        "float_tensor",
        "list",
        "vector_tensor",
        "negative",
    ],
)
def test_gradient_faults_validate_the_step(step, error, match):
    faults = GradientFaults({1: ("inf", [0])})
    with pytest.raises(error, match=match):
        faults([tf.constant([1.0, 2.0])], step)
    # Checked even when nothing is scheduled.
    with pytest.raises(error, match=match):
        GradientFaults({})([tf.constant([1.0, 2.0])], step)


@pytest.mark.parametrize(
    "make_step",
    [
        lambda: np.int64(1),
        lambda: tf.constant(1, tf.int32),
        lambda: tf.Variable(1, dtype=tf.int64),
        lambda: keras.Variable(1, dtype="int64"),
    ],
    ids=["numpy_int", "int32_tensor", "tf_variable", "keras_variable"],
)
def test_gradient_faults_accept_integer_scalar_steps(make_step):
    faults = GradientFaults({1: ("inf", [0])})
    result = faults([tf.constant([1.0, 2.0])], make_step())
    assert np.array(result[0]).tolist() == [np.inf, 2.0]


def test_gradient_faults_check_a_symbolic_step_once_at_trace_time():
    faults = GradientFaults({1: ("inf", [0])})
    run = tf.function(lambda step: faults([tf.constant([1.0])], step)[0])
    assert np.array(run(tf.constant(0))).tolist() == [1.0]
    assert np.array(run(tf.constant(1))).tolist() == [np.inf]
    assert run.experimental_get_tracing_count() == 1
    vector = tf.function(
        lambda step: faults([tf.constant([1.0])], step)[0],
        input_signature=[tf.TensorSpec([None], tf.int64)],
    )
    with pytest.raises(TypeError, match="'step' must be an integer scalar"):
        vector.get_concrete_function()


@pytest.mark.parametrize(
    "gradients, match",
    [
        (tf.ones(2), "'gradients' must be a list or tuple.*gradients=<tf"),
        (None, "'gradients' must be a list or tuple.*gradients=None"),
        (
            [(tf.ones(2), tf.ones(2))],
            "not \\(gradient, variable\\) pairs.*gradients\\[0\\]=\\(",
        ),
        ([tf.ones(2), "g"], "gradients\\[1\\]='g' of type str"),
        (
            [tf.ones(2, tf.int32)],
            "targets gradient 0, but only a floating-point.*"
            "gradients\\[0\\] of dtype int32",
        ),
    ],
    ids=["tensor", "none", "pairs", "str_entry", "int_gradient"],
)
def test_gradient_faults_validate_the_gradients(gradients, match):
    with pytest.raises(TypeError, match=match):
        GradientFaults({1: ("inf", [0])})(gradients, 1)


def test_gradient_faults_pass_unscheduled_integer_gradients_through():
    faults = GradientFaults({1: ("inf", [0])})
    result = faults((tf.constant([1.0]), tf.constant([2], tf.int32)), 1)
    assert np.array(result[0]).tolist() == [np.inf]
    assert np.array(result[1]).tolist() == [2]


def test_gradient_faults_reject_a_replica_beyond_the_replicas(two_replicas):
    gradients = [tf.constant([1.0])]
    faults = GradientFaults({0: ("inf", [0])}, replica=1)
    with pytest.raises(ValueError, match="in sync, 1 here.*replica=1"):
        faults(gradients, 0)
    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    with pytest.raises(ValueError, match="in sync, 1 here.*replica=1"):
        one_device.run(lambda: faults(gradients, 0))
    faults = GradientFaults({0: ("inf", [0])}, replica=2)
    run = tf.function(lambda: two_replicas.run(lambda: faults(gradients, 0)))
    with pytest.raises(ValueError, match="in sync, 2 here.*replica=2"):
        run()


def test_overflow_at_rejects_a_replica_beyond_the_replicas():
    layer = OverflowAt(steps=[0], replica=1)
    with pytest.raises(ValueError, match="in sync, 1 here.*replica=1"):
        layer(tf.constant([1.0]), training=True)


def test_gradient_faults_reject_an_index_without_a_gradient():
    with pytest.raises(ValueError, match="targets gradient 1"):
        GradientFaults({0: ("inf", [1])})([tf.constant(1.0), None], 0)
    with pytest.raises(ValueError, match="targets gradient 5"):
        GradientFaults({0: ("inf", [5])})([tf.constant(1.0)], 0)


def test_overflow_at_overflows_float16_only_on_its_steps():
    layer = OverflowAt(steps=[1, 3], dtype="float16")
    x = tf.constant([[0.5, -2.0]])
    outputs = [np.array(layer(x, training=True)) for _ in range(5)]
    assert np.isinf(outputs[1]).all() and np.isinf(outputs[3]).all()
    for index in (0, 2, 4):
        assert outputs[index].tolist() == [[0.5, -2.0]]
    assert int(np.array(layer.calls)) == 5
    # Inference calls pass through and are not counted.
    assert np.array(layer(x)).tolist() == [[0.5, -2.0]]
    assert int(np.array(layer.calls)) == 5


def test_overflow_at_stays_finite_in_float32():
    layer = OverflowAt(steps=[0], dtype="float32")
    output = np.array(layer(tf.constant([[0.5, -2.0]]), training=True))
    assert output.tolist() == [[0.5 * 2**17, -2.0 * 2**17]]


def test_overflow_at_gradients_stay_finite_on_other_steps():
    # A tf.where between the two results would give 0 * inf = NaN here.
    layer = OverflowAt(steps=[1], dtype="float16")
    x = tf.constant([[0.0, 1.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(tf.cast(layer(x, training=True), tf.float32))
    assert np.array(tape.gradient(y, x)).tolist() == [[1.0, 1.0]]


def test_overflow_at_under_mixed_float16_in_a_model_round_trips(tmp_path):
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((2,)), OverflowAt(steps=[2, 5], factor=1e5)]
    )
    assert model.layers[0].compute_dtype == "float16"
    path = str(tmp_path / "overflow.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.layers[0].steps == [2, 5]
    assert loaded.layers[0].factor == 1e5
    assert loaded.layers[0].get_config()["replica"] is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"steps": "1"}, TypeError, "steps='1'"),
        ({"steps": [1, -2]}, ValueError, "steps=-2"),
        ({"steps": 1.5}, TypeError, "steps=1.5"),
        ({"steps": []}, ValueError, "non-empty.*steps=\\[\\]"),
        ({"steps": {1: 2}}, TypeError, "steps=\\{1: 2\\}, of type dict"),
        ({"steps": 1, "factor": "big"}, TypeError, "factor='big'"),
        ({"steps": 1, "factor": float("inf")}, ValueError, "factor=inf"),
        ({"steps": 1, "factor": 0}, ValueError, "factor=0"),
        ({"steps": 1, "factor": 1e40}, ValueError, "float32.*factor=1e\\+40"),
        ({"steps": 1, "factor": float("nan")}, ValueError, "factor=nan"),
        ({"steps": 1, "replica": 1.0}, TypeError, "replica=1.0"),
        (
            {"steps": 1, "factor": np.float16(np.inf)},
            ValueError,
            r"factor=np\.float16\(inf\)",
        ),
    ],
    ids=[
        "str_steps",
        "negative_step",
        "float_steps",
        "empty_steps",
        "dict_steps",
        "str_factor",
        "inf_factor",
        "zero_factor",
        "beyond_float32_factor",
        "nan_factor",
        "float_replica",
        "float16_inf_factor",
    ],
)
def test_overflow_at_validates_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        OverflowAt(**kwargs)


def test_overflow_at_takes_steps_as_int_list_tuple_or_set():
    assert OverflowAt(steps=np.int64(2)).steps == [2]
    assert OverflowAt(steps=(3, 1, 3)).steps == [1, 3]
    assert OverflowAt(steps={4}).steps == [4]


def test_overflow_at_accepts_the_largest_float32_factor():
    largest = float(np.finfo(np.float32).max)
    layer = OverflowAt(steps=[0], factor=largest, dtype="float32")
    output = np.array(layer(tf.constant([1.0]), training=True))
    assert output.tolist() == [np.float32(largest)]
