"""The custom-loop calls misused: get_scaled_loss, scale_loss,
get_unscaled_gradients, apply_gradients, apply and the stateless_* ones.

Wrong nesting, exhausted iterables, tensors of the wrong kind, non-finite
values: a TypeError / ValueError at the call with every variable unchanged,
or Keras's own result bit for bit.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.adversarial._support import LSO
from tests.adversarial._support import assert_bits_equal
from tests.adversarial._support import refused
from tests.adversarial._support import scale_of
from tests.adversarial._support import values

NAN = float("nan")


@pytest.fixture
def setup():
    """A built optimizer (Adam, so slots exist) and two variables."""
    a = keras.Variable(np.ones((2, 3), "float32"), name="a")
    b = keras.Variable(np.ones(3, "float32"), name="b")
    optimizer = LSO(keras.optimizers.Adam(0.1))
    optimizer.apply_gradients([(tf.ones((2, 3)), a), (tf.ones(3), b)])
    return optimizer, a, b


# --- get_scaled_loss / scale_loss ---

BAD_LOSSES = {
    "int_tensor": (tf.constant(3), TypeError),
    "int": (3, TypeError),
    "bool": (True, TypeError),
    "numpy_bool": (np.bool_(True), TypeError),
    "bool_tensor": (tf.constant(True), TypeError),
    "string": ("0.5", TypeError),
    "none": (None, TypeError),
    "dict": ({"loss": 1.0}, TypeError),
    "complex_tensor": (tf.constant(1 + 1j), TypeError),
    "int_array": (np.array([1, 2]), TypeError),
    "object": (object(), TypeError),
    "overflowing_float": (1e39, ValueError),
}


@pytest.mark.parametrize("method", ["get_scaled_loss", "scale_loss"])
@pytest.mark.parametrize("loss", list(BAD_LOSSES), ids=list(BAD_LOSSES))
def test_bad_loss_refused(setup, method, loss):
    optimizer, a, b = setup
    value, error = BAD_LOSSES[loss]
    with refused(error, "loss", optimizer, a, b):
        getattr(optimizer, method)(value)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("method", ["get_scaled_loss", "scale_loss"])
def test_scaled_loss_keeps_its_dtype(method, dtype):
    optimizer = LSO(keras.optimizers.SGD(), initial_scale=2.0**10)
    loss = tf.constant(1.5, dtype)
    scaled = getattr(optimizer, method)(loss)
    assert scaled.dtype == loss.dtype
    assert float(scaled) == 1.5 * 2**10


@pytest.mark.parametrize(
    "loss",
    [
        0.5,
        np.float32(0.5),
        np.float64(0.5),
        keras.Variable(0.5),
        tf.Variable(0.5),
        np.array(0.5, "float32"),
        [0.5],
    ],
    ids=[
        "float",
        "np32",
        "np64",
        "keras_variable",
        "tf_variable",
        "array",
        "list",
    ],
)
def test_number_like_losses(loss):
    optimizer = LSO(keras.optimizers.SGD(), initial_scale=8)
    scaled = optimizer.get_scaled_loss(loss)
    assert np.all(keras.ops.convert_to_numpy(scaled) == 4.0)


def test_callable_loss_gives_a_callable():
    optimizer = LSO(keras.optimizers.SGD(), initial_scale=8)
    scaled = optimizer.get_scaled_loss(lambda: tf.constant(0.5))
    assert callable(scaled) and float(scaled()) == 4.0
    bad = optimizer.get_scaled_loss(lambda: tf.constant(1))
    with pytest.raises(TypeError, match="loss"):
        bad()


@pytest.mark.parametrize("value", [NAN, float("inf")])
def test_non_finite_loss_is_scaled_and_skips(value):
    variable = keras.Variable([1.0])
    optimizer = LSO(keras.optimizers.SGD(0.5))
    with tf.GradientTape() as tape:
        loss = optimizer.get_scaled_loss(variable[0] * value)
    grads = optimizer.get_unscaled_gradients(tape.gradient(loss, [variable]))
    optimizer.apply_gradients(zip(grads, [variable]))
    assert variable.numpy()[0] == 1.0
    assert int(optimizer.skipped_steps) == 1
    assert scale_of(optimizer) == 2.0**14


# --- get_unscaled_gradients ---

BAD_GRADIENT_LISTS = {
    "tensor": tf.ones(3),
    "variable": keras.Variable([1.0]),
    "none": None,
    "string": "grads",
    "dict": {"a": tf.ones(3)},
    "number": 1.0,
    "indexed_slices": tf.IndexedSlices(
        tf.ones((1, 2)), tf.constant([0]), tf.constant([3, 2])
    ),
    "int_entry": [tf.constant([1, 2])],
    "bool_entry": [True],
    "string_entry": ["g"],
    "complex_entry": [tf.constant([1 + 1j])],
}


@pytest.mark.parametrize(
    "grads", list(BAD_GRADIENT_LISTS), ids=list(BAD_GRADIENT_LISTS)
)
def test_bad_gradient_lists_refused(setup, grads):
    optimizer, a, b = setup
    with refused(TypeError, "grads", optimizer, a, b):
        optimizer.get_unscaled_gradients(BAD_GRADIENT_LISTS[grads])


def test_unscaled_gradients_each_in_its_dtype():
    optimizer = LSO(keras.optimizers.SGD(), initial_scale=2.0**15)
    grads = [
        tf.constant([65504.0], tf.float16),
        tf.constant([2.0**-10], tf.float16),
        tf.constant([3.0 * 2**15], tf.bfloat16),
        tf.constant([2.0**15], tf.float32),
        tf.constant([1e300], tf.float64),
        None,
        tf.IndexedSlices(
            tf.constant([[2.0**16]]), tf.constant([1]), tf.constant([3, 1])
        ),
        np.array([2.0**15], "float32"),
    ]
    out = optimizer.get_unscaled_gradients(grads)
    assert len(out) == len(grads)
    expected = [
        ("float16", 65504.0 / 2**15),
        ("float16", 2.0**-25),  # Divided in float32: not flushed to 0.
        ("bfloat16", 3.0),
        ("float32", 1.0),
        ("float64", 1e300 / 2**15),
    ]
    for tensor, (dtype, value) in zip(out, expected):
        assert tensor.dtype == dtype
        assert float(tensor[0]) == np.asarray(value, dtype=dtype).item()
    assert out[5] is None
    assert isinstance(out[6], tf.IndexedSlices)
    assert float(out[6].values[0, 0]) == 2.0
    assert out[6].indices.numpy().tolist() == [1]
    assert float(out[7][0]) == 1.0


def test_unscaled_gradients_of_iterators():
    optimizer = LSO(keras.optimizers.SGD(), initial_scale=4)
    assert optimizer.get_unscaled_gradients(iter([])) == []
    out = optimizer.get_unscaled_gradients(g for g in [tf.ones(2) * 4])
    assert out[0].numpy().tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        optimizer.get_unscaled_gradients([(g for g in [tf.ones(2)])])


# --- apply_gradients / apply ---

BAD_PAIRS = {
    "dict": (lambda a, b: {"a": (tf.ones((2, 3)), a)}, TypeError),
    "string": (lambda a, b: "pairs", TypeError),
    "none": (lambda a, b: None, TypeError),
    "one_pair_unwrapped": (lambda a, b: (tf.ones((2, 3)), a), TypeError),
    "list_of_gradients": (
        lambda a, b: [tf.ones((2, 3)), tf.ones(3)],
        TypeError,
    ),
    "triple": (lambda a, b: [(tf.ones((2, 3)), a, 1)], TypeError),
    "single": (lambda a, b: [(tf.ones((2, 3)),)], TypeError),
    "nested": (lambda a, b: [[(tf.ones((2, 3)), a)]], TypeError),
    "swapped": (lambda a, b: [(a, tf.ones((2, 3)))], TypeError),
    "tensor_as_variable": (
        lambda a, b: [(tf.ones((2, 3)), tf.ones((2, 3)))],
        TypeError,
    ),
    "numpy_as_variable": (
        lambda a, b: [(tf.ones(3), np.ones(3, "float32"))],
        TypeError,
    ),
    "int_gradient": (lambda a, b: [(tf.ones((2, 3), "int32"), a)], TypeError),
    "string_gradient": (lambda a, b: [("g", b)], TypeError),
    "wrong_shape": (lambda a, b: [(tf.ones((3, 2)), a)], ValueError),
    "transposed_pair_shapes": (
        lambda a, b: [(tf.ones(3), a), (tf.ones((2, 3)), b)],
        ValueError,
    ),
    "scalar_for_vector": (lambda a, b: [(tf.constant(1.0), b)], ValueError),
    "broadcastable": (lambda a, b: [(tf.ones((1, 3)), a)], ValueError),
    "sparse_wrong_columns": (
        lambda a, b: [
            (
                tf.IndexedSlices(
                    tf.ones((1, 4)), tf.constant([0]), tf.constant([2, 4])
                ),
                a,
            )
        ],
        ValueError,
    ),
    "sparse_for_scalar": (
        lambda a, b: [
            (
                tf.IndexedSlices(tf.ones(1), tf.constant([0])),
                keras.Variable(1.0),
            )
        ],
        ValueError,
    ),
    "exhausted_zip": (None, ValueError),
    "empty": (lambda a, b: [], ValueError),
    "empty_generator": (lambda a, b: (p for p in []), ValueError),
}


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("pairs", list(BAD_PAIRS), ids=list(BAD_PAIRS))
def test_bad_pairs_refused(setup, pairs, mode):
    optimizer, a, b = setup
    make, error = BAD_PAIRS[pairs]
    if make is None:
        used = zip([tf.ones((2, 3))], [a])
        list(used)
        make = lambda a, b: used  # noqa: E731
    call = lambda: optimizer.apply_gradients(make(a, b))  # noqa: E731
    if mode == "tf_function":
        call = tf.function(call)
    with refused(error, None, optimizer, a, b):
        call()


def test_unknown_variable_refused(setup):
    optimizer, a, b = setup
    other = keras.Variable(np.ones(3, "float32"))
    with refused(ValueError, None, optimizer, a, b, other):
        optimizer.apply_gradients([(tf.ones(3), other)])


def test_apply_counts_and_build():
    optimizer = LSO(keras.optimizers.Adam())
    with pytest.raises(ValueError, match="build"):
        optimizer.apply([tf.ones(2)])
    a = keras.Variable([1.0, 1.0])
    optimizer.build([a])
    with refused(ValueError, "gradient", optimizer, a):
        optimizer.apply([tf.ones(2), tf.ones(2)])
    with refused(ValueError, "gradient", optimizer, a):
        optimizer.apply([tf.ones(2)], [a, a])


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_gradients_keras_accepts_give_keras_results(mode):
    """Gradients of another float dtype, NumPy arrays, lists, a variable as
    its own gradient: as plain Keras does, bit for bit."""

    def run(make):
        a = keras.Variable([1.0, 2.0])
        b = keras.Variable([3.0, 4.0])
        c = keras.Variable([5.0, 6.0])
        t = keras.Variable([7.0, 8.0])
        optimizer = make()

        def step():
            optimizer.apply_gradients(
                [
                    (tf.constant([0.3, 0.7], tf.float16), a),
                    (np.array([0.1, 0.2], "float64"), b),
                    (c, c),
                    ([0.5, 0.25], t),
                ]
            )

        step = step if mode == "eager" else tf.function(step)
        step()
        step()
        return values(a, b, c, t)

    expected = run(lambda: keras.optimizers.Adam(0.1))
    assert_bits_equal(run(lambda: LSO(keras.optimizers.Adam(0.1))), expected)


@pytest.mark.xfail(
    strict=True,
    reason="KMP BUG: in a tf.function, a step whose variables include a "
    "tf.Variable (kmp then applies in a tf.cond) and whose gradients "
    "include a tensor captured from outside the function fails with "
    "TensorFlow's 'All custom_gradient outputs should be from the same "
    "graph' (Keras's _all_reduce_sum_gradients inside the cond branch of "
    "kmp.core.tensorflow.step); Keras alone applies it",
)
def test_tf_variable_and_captured_gradient_in_a_tf_function():
    def run(make):
        a = keras.Variable([1.0, 2.0])
        t = tf.Variable([7.0, 8.0])
        captured = tf.constant([0.5, 0.25])
        optimizer = make()
        step = tf.function(
            lambda: optimizer.apply_gradients(
                [(captured, a), (tf.constant([1.0, 1.0]), t)]
            )
        )
        step()
        return values(a, t)

    expected = run(lambda: keras.optimizers.SGD(0.1))
    assert_bits_equal(run(lambda: LSO(keras.optimizers.SGD(0.1))), expected)


def test_cross_replica_context_refused(two_replicas):
    with two_replicas.scope():
        variable = keras.Variable([1.0, 2.0])
        optimizer = LSO(keras.optimizers.SGD(0.1))
    with two_replicas.scope():
        with refused(ValueError, "replica context", optimizer, variable):
            optimizer.apply_gradients([(tf.ones(2), variable)])


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_sparse_gradients(mode):
    def run(make):
        table = keras.Variable(np.ones((4, 2), "float32"))
        optimizer = make()
        grads = tf.IndexedSlices(
            tf.constant([[1.0, 2.0], [NAN, 1.0]]),
            tf.constant([1, 3]),
            tf.constant([4, 2]),
        )
        good = tf.IndexedSlices(
            tf.constant([[1.0, 2.0]]), tf.constant([2]), tf.constant([4, 2])
        )

        def step(g):
            optimizer.apply_gradients([(g, table)])

        if mode == "tf_function":
            step = tf.function(step)
        if isinstance(optimizer, LSO):
            step(grads)  # Skipped.
        step(good)
        return values(table, optimizer.iterations)

    expected = run(lambda: keras.optimizers.Adam(0.1))
    assert_bits_equal(run(lambda: LSO(keras.optimizers.Adam(0.1))), expected)


# --- stateless_* ---


def test_stateless_calls_check_their_arguments(setup):
    optimizer, a, b = setup
    state = [v.value for v in optimizer.variables]
    with refused(ValueError, "optimizer_variables", optimizer, a, b):
        optimizer.stateless_scale_loss(state[:-1], 1.0)
    with refused(ValueError, "optimizer_variables", optimizer, a, b):
        optimizer.stateless_unscale_gradients(state + state, [tf.ones(3)])
    with refused(TypeError, "grads", optimizer, a, b):
        optimizer.stateless_unscale_gradients(state, tf.ones(3))
    with refused(ValueError, None, optimizer, a, b):
        optimizer.stateless_apply(state, [tf.ones((2, 3))], [a.value, b.value])
    with refused(ValueError, None, optimizer, a, b):
        optimizer.stateless_apply(state[1:], [None, None], [a.value, b.value])
    assert float(optimizer.stateless_scale_loss(state, 0.5)) == 2.0**14
    (unscaled,) = optimizer.stateless_unscale_gradients(
        state, [tf.constant(2.0**15)]
    )
    assert float(unscaled) == 1.0
    unbuilt = LSO(keras.optimizers.Adam())
    with pytest.raises(ValueError, match="built"):
        unbuilt.stateless_apply([], [], [])


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "nan"])
def test_stateless_apply_on_tensorflow_is_consistent(setup, finite):
    optimizer, a, b = setup
    state = [v.value for v in optimizer.variables]
    grads = [tf.ones((2, 3)), tf.constant([1.0, 1.0, NAN if not finite else 1])]
    try:
        optimizer.stateless_apply(state, grads, [a.value, b.value])
        outcome = "returned"
    except ValueError as error:
        assert "Cond" not in str(error)
        outcome = "refused"
    other = [
        tf.ones((2, 3)),
        tf.constant([1.0, 1.0, 1.0 if not finite else NAN]),
    ]
    try:
        optimizer.stateless_apply(state, other, [a.value, b.value])
        assert outcome == "returned"
    except ValueError:
        assert outcome == "refused"
