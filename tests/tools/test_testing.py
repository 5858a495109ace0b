"""Tests for kmp.tools.testing: GradientFaults and OverflowAt.

They run on every backend; the parts only TensorFlow has (`tf.IndexedSlices`
gradients, `tf.distribute` replicas, `tf.function` tracing) carry the
`tensorflow` marker.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.tools.testing import GradientFaults
from kmp.tools.testing import OverflowAt
from tests.support import backends
from tests.support import training
from tests.support.backends import tensor


def _grads():
    return [
        tensor([1.0, 2.0]),
        None,
        tensor([[3.0, 4.0]]),
        tensor(5.0, "float16"),
    ]


def _values(gradient):
    if gradient is None:
        return None
    if backends.TENSORFLOW and isinstance(
        gradient, backends.tensorflow().IndexedSlices
    ):
        gradient = gradient.values
    return keras.ops.convert_to_numpy(gradient).tolist()


@pytest.mark.parametrize("mode", backends.MODES)
def test_gradient_faults_hit_only_the_scheduled_step_and_gradients(mode):
    faults = GradientFaults({2: ("inf", [0, 3]), 4: ("nan", [2])})
    if mode == "jit":  # XLA takes no None gradient.
        dense = GradientFaults({2: ("inf", [0])})
        run_jit = training.compiled(
            lambda step: dense([tensor([1.0, 2.0])], step), mode
        )
        assert _values(run_jit(tensor(1, "int32"))[0]) == [1.0, 2.0]
        assert _values(run_jit(tensor(2, "int32"))[0]) == [np.inf, 2.0]
        return
    run = training.compiled(lambda step: faults(_grads(), step), mode)
    clean = [_values(g) for g in _grads()]
    for step in (0, 1, 3, 5):
        assert [_values(g) for g in run(tensor(step, "int32"))] == clean
    at_2 = [_values(g) for g in run(tensor(2, "int32"))]
    assert at_2 == [[np.inf, 2.0], None, [[3.0, 4.0]], np.inf]
    at_4 = run(tensor(4, "int32"))
    assert np.isnan(_values(at_4[2])[0][0])
    assert _values(at_4[2])[0][1] == 4.0
    assert backends.dtype(at_4[3]) == "float16"


@pytest.mark.tensorflow
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_gradient_faults_write_into_indexed_slices(mode):
    tf = backends.tensorflow()
    slices = tf.IndexedSlices(
        tf.constant([[3.0, 4.0]]), tf.constant([1]), tf.constant([3, 2])
    )
    faults = GradientFaults({4: ("nan", [0])})
    run = training.compiled(lambda step: faults([slices], step)[0], mode)
    assert _values(run(tf.constant(3))) == [[3.0, 4.0]]
    at_4 = run(tf.constant(4, tf.int64))
    assert isinstance(at_4, tf.IndexedSlices)
    assert np.isnan(_values(at_4)[0][0]) and _values(at_4)[0][1] == 4.0
    assert np.array(at_4.indices).tolist() == [1]


# --- Replicas (tf.distribute) -----------------------------------------------


@pytest.mark.tensorflow
def test_gradient_faults_on_one_replica_only(two_replicas):
    tf = backends.tensorflow()
    faults = GradientFaults({0: ("inf", [0])}, replica=1)

    @tf.function
    def run():
        return two_replicas.run(lambda: faults([tf.constant([1.0])], 0)[0])

    per_replica = two_replicas.experimental_local_results(run())
    assert [np.array(v).tolist() for v in per_replica] == [[1.0], [np.inf]]


@pytest.mark.tensorflow
def test_gradient_faults_for_one_replica_need_a_replica_context(
    two_replicas,
):
    faults = GradientFaults({0: ("inf", [0])}, replica=1)
    with two_replicas.scope():
        with pytest.raises(ValueError, match="replica context"):
            faults([tensor([1.0])], 0)


@pytest.mark.tensorflow
def test_gradient_faults_reject_a_replica_beyond_the_replicas(two_replicas):
    tf = backends.tensorflow()
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


@pytest.mark.tensorflow
def test_overflow_at_rejects_a_replica_beyond_the_replicas():
    layer = OverflowAt(steps=[0], replica=1)
    with pytest.raises(ValueError, match="in sync, 1 here.*replica=1"):
        layer(tensor([1.0]), training=True)


@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize(
    "make", [GradientFaults, OverflowAt], ids=["gradient_faults", "overflow_at"]
)
def test_a_replica_off_tensorflow_is_refused_naming_what_to_do(make):
    first = {0: ("inf", [0])} if make is GradientFaults else [0]
    with pytest.raises(ValueError) as raised:
        make(first, replica=1)
    message = str(raised.value)
    assert "tf.distribute" in message and "TensorFlow backend" in message
    assert f"Keras runs on '{backends.NAME}': pass replica=None" in message
    assert message.endswith("Received: replica=1")
    if backends.JAX:
        assert "keras.distribution.DataParallel" in message
    make(first, replica=None)  # Every device: allowed.


# --- GradientFaults: arguments -----------------------------------------------


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
    "make_step, error, match",
    [
        (lambda: "1", TypeError, "'step' must be an integer scalar.*step='1'"),
        (lambda: None, TypeError, "step=None"),
        (lambda: True, TypeError, "step=True"),
        (lambda: 1.5, TypeError, "step=1.5"),
        (lambda: tensor(1.7), TypeError, "integer scalar.*step=.*1.7"),
        (lambda: [1], TypeError, "step=\\[1\\]"),
        (
            lambda: tensor([0, 1], "int32"),
            TypeError,
            "integer scalar.*Received: step=",
        ),
        (lambda: -1, ValueError, "step=-1"),
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
def test_gradient_faults_validate_the_step(make_step, error, match):
    faults = GradientFaults({1: ("inf", [0])})
    with pytest.raises(error, match=match):
        faults([tensor([1.0, 2.0])], make_step())
    # Checked even when nothing is scheduled.
    with pytest.raises(error, match=match):
        GradientFaults({})([tensor([1.0, 2.0])], make_step())


@pytest.mark.parametrize(
    "make_step",
    [
        lambda: np.int64(1),
        lambda: tensor(1, "int32"),
        lambda: keras.Variable(1, dtype="int32", trainable=False),
    ],
    ids=["numpy_int", "int32_tensor", "keras_variable"],
)
def test_gradient_faults_accept_integer_scalar_steps(make_step):
    faults = GradientFaults({1: ("inf", [0])})
    result = faults([tensor([1.0, 2.0])], make_step())
    assert _values(result[0]) == [np.inf, 2.0]


@pytest.mark.tensorflow
def test_gradient_faults_accept_a_tf_variable_step():
    tf = backends.tensorflow()
    faults = GradientFaults({1: ("inf", [0])})
    result = faults([tf.constant([1.0, 2.0])], tf.Variable(1, dtype=tf.int64))
    assert _values(result[0]) == [np.inf, 2.0]


@pytest.mark.tensorflow
def test_gradient_faults_check_a_symbolic_step_once_at_trace_time():
    tf = backends.tensorflow()
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


@pytest.mark.jax
def test_gradient_faults_serve_every_step_from_one_jit_trace():
    import jax

    faults = GradientFaults({1: ("inf", [0])})
    traces = []

    def run(step):
        traces.append(step)
        return faults([tensor([1.0])], step)[0]

    jitted = jax.jit(run)
    assert _values(jitted(tensor(0, "int32"))) == [1.0]
    assert _values(jitted(tensor(1, "int32"))) == [np.inf]
    assert _values(jitted(tensor(2, "int32"))) == [1.0]
    assert len(traces) == 1
    with pytest.raises(TypeError, match="'step' must be an integer scalar"):
        jax.jit(run)(tensor([0, 1], "int32"))


@pytest.mark.parametrize(
    "make_gradients, match",
    [
        (lambda: tensor([1.0, 1.0]), "'gradients' must be a list or tuple"),
        (lambda: None, "'gradients' must be a list or tuple.*gradients=None"),
        (
            lambda: [(tensor([1.0, 1.0]), tensor([1.0, 1.0]))],
            "not \\(gradient, variable\\) pairs.*gradients\\[0\\]=\\(",
        ),
        (
            lambda: [tensor([1.0, 1.0]), "g"],
            "gradients\\[1\\]='g' of type str",
        ),
        (
            lambda: [tensor([1, 1], "int32")],
            "targets gradient 0, but only a floating-point.*"
            "gradients\\[0\\] of dtype int32",
        ),
    ],
    ids=["tensor", "none", "pairs", "str_entry", "int_gradient"],
)
def test_gradient_faults_validate_the_gradients(make_gradients, match):
    with pytest.raises(TypeError, match=match):
        GradientFaults({1: ("inf", [0])})(make_gradients(), 1)


def test_gradient_faults_name_indexed_slices_only_on_tensorflow():
    with pytest.raises(TypeError) as raised:
        GradientFaults({1: ("inf", [0])})(["g"], 1)
    assert ("tf.IndexedSlices" in str(raised.value)) == backends.TENSORFLOW


def test_gradient_faults_pass_unscheduled_integer_gradients_through():
    faults = GradientFaults({1: ("inf", [0])})
    result = faults((tensor([1.0]), tensor([2], "int32")), 1)
    assert _values(result[0]) == [np.inf]
    assert _values(result[1]) == [2]


def test_gradient_faults_reject_an_index_without_a_gradient():
    with pytest.raises(ValueError, match="targets gradient 1"):
        GradientFaults({0: ("inf", [1])})([tensor(1.0), None], 0)
    with pytest.raises(ValueError, match="targets gradient 5"):
        GradientFaults({0: ("inf", [5])})([tensor(1.0)], 0)


# --- OverflowAt ---------------------------------------------------------------


def test_overflow_at_overflows_float16_only_on_its_steps():
    layer = OverflowAt(steps=[1, 3], dtype="float16")
    x = tensor([[0.5, -2.0]])
    outputs = [_values(layer(x, training=True)) for _ in range(5)]
    assert np.isinf(outputs[1]).all() and np.isinf(outputs[3]).all()
    for index in (0, 2, 4):
        assert outputs[index] == [[0.5, -2.0]]
    assert int(keras.ops.convert_to_numpy(layer.calls)) == 5
    # Inference calls pass through and are not counted.
    assert _values(layer(x)) == [[0.5, -2.0]]
    assert int(keras.ops.convert_to_numpy(layer.calls)) == 5


def test_overflow_at_stays_finite_in_float32():
    layer = OverflowAt(steps=[0], dtype="float32")
    output = _values(layer(tensor([[0.5, -2.0]]), training=True))
    assert output == [[0.5 * 2**17, -2.0 * 2**17]]


def test_overflow_at_gradients_stay_finite_on_other_steps():
    # A where() between the two results would give 0 * inf = NaN here.
    layer = OverflowAt(steps=[1], dtype="float16")
    x = keras.Variable([[0.0, 1.0]])

    def loss():
        return keras.ops.sum(keras.ops.cast(layer(x, training=True), "float32"))

    (gradient,) = backends.gradients(loss, [x])
    assert _values(gradient) == [[1.0, 1.0]]


def test_overflow_at_skips_exactly_its_steps_in_fit():
    # Calls 1 and 3 of the layer overflow float16: those steps are skipped,
    # the others applied, on every backend (under JAX's jit too, where the
    # call count is state fit carries from step to step).
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(2),
            OverflowAt(steps=[1, 3]),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    kmp.set_global_policy(None)
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=1024
    )
    model.compile(optimizer=optimizer, loss="mse")
    recorder = _Recorder()
    model.fit(
        np.ones((10, 2), "float32"),
        np.ones((10, 1), "float32"),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    assert recorder.states == [
        (1024.0, 0),
        (512.0, 1),
        (512.0, 1),
        (256.0, 2),
        (256.0, 2),
    ]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 3
    assert int(keras.ops.convert_to_numpy(model.layers[1].calls)) == 5


class _Recorder(keras.callbacks.Callback):
    """(loss scale, skipped steps) after every batch."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.states.append(
            (float(optimizer.loss_scale), int(optimizer.skipped_steps))
        )


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
    output = _values(layer(tensor([1.0]), training=True))
    assert output == [np.float32(largest)]
