"""Tests for kmp.optimizer.LossScaleOptimizer on a single device.

They pin down the "Loss scaling" section of the contract. Many guard against
a Keras 3.15 behaviour: a constructor that accepts anything and mutates the
inner optimizer, a loss scaled in float16 before the optimizer is built, a
scale that halves below 1 or doubles to inf, gradients unscaled twice in a
custom loop, an optimizer dropped when a model is loaded under another policy.
Distributed training is tested in another file.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import kmp
from kmp import LossScaleOptimizer

MODES = ["eager", "tf_function", "jit"]
INF = float("inf")
NAN = float("nan")

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(24, 4)).astype("float32")
Y = _RNG.normal(size=(24, 2)).astype("float32")
BATCH_SIZE = 8
# Copied into every model, so all runs start from the same weights.
INITIAL_WEIGHTS = [
    _RNG.normal(scale=0.5, size=(4, 8)).astype("float32"),
    _RNG.normal(scale=0.1, size=(8,)).astype("float32"),
    _RNG.normal(scale=0.5, size=(8, 2)).astype("float32"),
    _RNG.normal(scale=0.1, size=(2,)).astype("float32"),
]

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


# --- Helpers ------------------------------------------------------------------


def _model():
    """A tiny float32 regression model with the shared initial weights."""
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    model.set_weights(INITIAL_WEIGHTS)
    return model


def _compile_kwargs(mode):
    return {
        "eager": {"run_eagerly": True},
        "tf_function": {},
        "jit": {"jit_compile": True},
    }[mode]


def _compiled(function, mode):
    if mode == "eager":
        return function
    return tf.function(function, jit_compile=mode == "jit")


def _fit_weights(optimizer, mode):
    """Trains `_model()` for one epoch of `model.fit`; returns its weights."""
    model = _model()
    model.compile(optimizer=optimizer, loss="mse", **_compile_kwargs(mode))
    model.fit(X, Y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
    return model.get_weights()


@functools.lru_cache(maxsize=None)
def _reference_weights(optimizer_name, mode):
    """The float32 reference: the plain optimizer in `model.fit`."""
    return _fit_weights(OPTIMIZERS[optimizer_name](), mode)


def _loop_weights(optimizer, mode, protocol, transform=None):
    """Trains `_model()` one epoch in a custom loop; returns its weights.

    `protocol` is "contract" (get_scaled_loss / get_unscaled_gradients),
    "keras" (scale_loss, scaled gradients straight to apply_gradients) or
    "plain" (no loss scaling). `transform` maps the gradients just before
    they are applied.
    """
    model = _model()
    loss_fn = keras.losses.MeanSquaredError()

    def train_step(x, y):
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if protocol == "contract":
                loss = optimizer.get_scaled_loss(loss)
            elif protocol == "keras":
                loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, variables)
        if protocol == "contract":
            grads = optimizer.get_unscaled_gradients(grads)
        if transform is not None:
            grads = transform(grads)
        optimizer.apply_gradients(zip(grads, variables))

    train_step = _compiled(train_step, mode)
    for start in range(0, len(X), BATCH_SIZE):
        batch = slice(start, start + BATCH_SIZE)
        train_step(tf.constant(X[batch]), tf.constant(Y[batch]))
    return model.get_weights()


def _assert_weights_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def _values(variables):
    return [np.array(v) for v in variables]


def _optimizer_state(optimizer):
    """The current (scale, counter, skipped_steps, iterations)."""
    counter = optimizer.dynamic_counter
    return (
        float(optimizer.loss_scale),
        None if counter is None else int(counter),
        int(optimizer.skipped_steps),
        int(optimizer.iterations),
    )


class _Harness:
    """One model and optimizer, trained one step at a time.

    The loss is the mean squared error times `factor`, a variable: setting it
    to inf or NaN makes every gradient of that step non-finite.

    Args:
        optimizer: The kmp.LossScaleOptimizer to train with.
        how: "loop_<mode>" for the contract's custom loop or "fit_<mode>" for
            `model.fit`, with <mode> one of MODES.
    """

    def __init__(self, optimizer, how):
        self.model = _model()
        self.optimizer = optimizer
        self.factor = tf.Variable(1.0)
        # Built up front so every slot exists before the first (maybe
        # skipped) step and can be compared.
        optimizer.build(self.model.trainable_variables)
        kind, mode = how.split("_", 1)
        self._fit = kind == "fit"
        if self._fit:
            self.model.compile(
                optimizer=optimizer, loss=self._loss, **_compile_kwargs(mode)
            )
        else:
            self._train_step = _compiled(self._loop_step, mode)

    def _loss(self, y_true, y_pred):
        return keras.losses.mean_squared_error(y_true, y_pred) * self.factor

    def _loop_step(self, x, y):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self._loss(y, self.model(x, training=True)))
            scaled_loss = self.optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, variables)
        grads = self.optimizer.get_unscaled_gradients(scaled_grads)
        self.optimizer.apply_gradients(zip(grads, variables))

    def snapshot(self):
        """Weights and every inner optimizer variable (slots, iterations)."""
        return _values(self.model.trainable_variables) + _values(
            self.optimizer.inner_optimizer.variables
        )

    def train(self, factors):
        """Takes one step on the same batch per entry of `factors`.

        Returns:
            For each step: the snapshot before it, the snapshot after it and
            the optimizer state after it.
        """
        records = []

        def begin(step):
            self.factor.assign(factors[step])
            records.append([self.snapshot()])

        def end(step):
            records[step] += [self.snapshot(), _optimizer_state(self.optimizer)]

        x, y = X[:BATCH_SIZE], Y[:BATCH_SIZE]
        if self._fit:
            # One fit call, the factor set between batches by a callback.
            callback = keras.callbacks.LambdaCallback(
                on_train_batch_begin=lambda step, logs: begin(step),
                on_train_batch_end=lambda step, logs: end(step),
            )
            repeats = (len(factors), 1)
            self.model.fit(
                np.tile(x, repeats),
                np.tile(y, repeats),
                batch_size=BATCH_SIZE,
                shuffle=False,
                verbose=0,
                callbacks=[callback],
            )
        else:
            for step in range(len(factors)):
                begin(step)
                self._train_step(tf.constant(x), tf.constant(y))
                end(step)
        assert len(records) == len(factors)
        return records

    def walk(self, factors, expected_states):
        """Trains one step per factor and checks the state after each.

        On a skipped step everything in `snapshot()` must be bit-for-bit
        unchanged; on an applied step something must change, and the weights
        must stay finite.
        """
        assert len(factors) == len(expected_states)
        records = self.train(factors)
        skipped_before = 0
        for step, ((before, after, state), expected) in enumerate(
            zip(records, expected_states)
        ):
            assert state == expected, f"step {step}"
            weights = after[: len(self.model.trainable_variables)]
            assert all(np.isfinite(w).all() for w in weights), f"step {step}"
            if state[2] > skipped_before:
                _assert_weights_equal(after, before)
            else:
                assert any(
                    not np.array_equal(a, b) for a, b in zip(after, before)
                ), f"step {step} changed nothing"
            skipped_before = state[2]


HARNESSES = [f"{kind}_{mode}" for kind in ("loop", "fit") for mode in MODES]
# Fit costs more than a loop; test_dynamic_scale_walk covers all of fit's
# modes, the other walks run fit in its default mode only.
FEWER_HARNESSES = [f"loop_{mode}" for mode in MODES] + ["fit_tf_function"]


def _assert_unchanged_by(optimizer, call):
    """Runs `call` and checks it left `optimizer` exactly as it was."""

    def attributes():
        snapshot = {}
        for name, value in vars(optimizer).items():
            if isinstance(value, (bool, int, float, str, type(None))):
                snapshot[name] = value
            elif isinstance(value, (list, tuple, dict)):
                snapshot[name] = (id(value), len(value))
            else:
                snapshot[name] = id(value)
        return snapshot

    config, attrs, values = (
        optimizer.get_config(),
        attributes(),
        _values(optimizer.variables),
    )
    call()
    assert optimizer.get_config() == config
    assert attributes() == attrs
    _assert_weights_equal(_values(optimizer.variables), values)


class _LegacyOptimizer:
    """Looks like a tf_keras (Keras 2) optimizer, but is no Keras 3 one."""

    learning_rate = 0.01

    def apply_gradients(self, grads_and_vars):
        del grads_and_vars

    def get_config(self):
        return {"learning_rate": self.learning_rate}


# --- 1. Constructor validation ------------------------------------------------


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

    _assert_unchanged_by(inner, construct)


@pytest.mark.parametrize(
    "initial_scale",
    [-1, 0, 0.5, INF, NAN, 1e39],
    ids=["negative", "zero", "half", "inf", "nan", "above_float32_max"],
)
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
def test_initial_scale_must_be_finite_and_at_least_one(dynamic, initial_scale):
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(
            ValueError, match="'initial_scale' must be a finite number >= 1"
        ):
            LossScaleOptimizer(
                inner, dynamic=dynamic, initial_scale=initial_scale
            )

    _assert_unchanged_by(inner, construct)


@pytest.mark.parametrize("initial_scale", ["8", True], ids=["string", "bool"])
def test_initial_scale_must_be_a_number(initial_scale):
    inner = keras.optimizers.Adam(0.01)

    def construct():
        # The contract promises ValueError; Python's convention, TypeError.
        for error in (ValueError, TypeError):
            with pytest.raises(error, match="'initial_scale' must be a number"):
                LossScaleOptimizer(inner, initial_scale=initial_scale)

    _assert_unchanged_by(inner, construct)


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

    _assert_unchanged_by(inner, construct)


def test_fixed_scale_requires_initial_scale():
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(
            ValueError, match="'initial_scale' is required when dynamic=False"
        ):
            LossScaleOptimizer(inner, dynamic=False)

    _assert_unchanged_by(inner, construct)


def test_fixed_scale_rejects_dynamic_growth_steps():
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(
            ValueError, match="applies only to a dynamic loss scale"
        ):
            LossScaleOptimizer(
                inner,
                dynamic=False,
                initial_scale=128,
                dynamic_growth_steps=100,
            )

    _assert_unchanged_by(inner, construct)


def test_dynamic_must_be_a_bool():
    inner = keras.optimizers.Adam(0.01)

    def construct():
        with pytest.raises(TypeError, match="'dynamic' must be True or False"):
            LossScaleOptimizer(inner, dynamic="yes")

    _assert_unchanged_by(inner, construct)


def test_inner_with_its_own_loss_scale_factor_is_rejected():
    inner = keras.optimizers.SGD(0.1, loss_scale_factor=128.0)

    def construct():
        with pytest.raises(ValueError, match="has its own loss_scale_factor"):
            LossScaleOptimizer(inner)

    _assert_unchanged_by(inner, construct)
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


# --- 2. Properties ------------------------------------------------------------


def test_properties():
    inner = keras.optimizers.SGD(0.25)
    optimizer = LossScaleOptimizer(
        inner, initial_scale=64, dynamic_growth_steps=10
    )
    assert optimizer.inner_optimizer is inner
    assert optimizer.initial_scale == 64.0
    assert optimizer.dynamic_growth_steps == 10

    scale = optimizer.loss_scale
    assert isinstance(scale, tf.Tensor)
    assert scale.dtype == tf.float32 and scale.shape == ()
    assert float(scale) == 64.0
    assert int(optimizer.dynamic_counter) == 0
    assert int(optimizer.skipped_steps) == 0
    assert int(optimizer.iterations) == 0


def test_learning_rate_reads_and_assigns_the_inner_optimizer():
    inner = keras.optimizers.SGD(0.25)
    optimizer = LossScaleOptimizer(inner)
    assert float(optimizer.learning_rate) == 0.25

    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate) == 0.5
    assert float(optimizer.learning_rate) == 0.5

    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(tf.constant([1.0]), variable)])
    # The update used the assigned learning rate: 1 - 0.5 * 1.
    np.testing.assert_array_equal(np.array(variable), [0.5])


def test_iterations_counts_applied_steps_of_the_inner_optimizer():
    inner = keras.optimizers.SGD(0.1)
    optimizer = LossScaleOptimizer(inner)
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(tf.constant([1.0]), variable)])
    optimizer.apply_gradients([(tf.constant([1.0]), variable)])
    assert int(optimizer.iterations) == 2
    assert int(inner.iterations) == 2
    assert int(optimizer.skipped_steps) == 0


def test_skipped_steps_counts_non_finite_steps():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(tf.constant([INF]), variable)])
    optimizer.apply_gradients([(tf.constant([NAN]), variable)])
    assert optimizer.skipped_steps.dtype == tf.int64
    assert int(optimizer.skipped_steps) == 2
    assert int(optimizer.iterations) == 0
    np.testing.assert_array_equal(np.array(variable), [1.0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "gradients",
    [
        ([INF], [-INF]),  # each alone is inf; their sums add up to NaN
        ([INF, 1.0], [1.0, -INF]),  # same shape, added elementwise first
        ([INF, -INF], [1.0]),  # cancels within one gradient: NaN
        ([3e38, 3e38], [1.0]),  # finite elements whose sum overflows
        ([3e38], [3e38]),  # finite gradients whose elementwise sum does
        ([1.0, 2.0], [NAN, 1.0], [3.0]),
    ],
    ids=[
        "inf_in_one_minus_inf_in_other",
        "inf_and_minus_inf_in_same_shapes",
        "inf_minus_inf",
        "sum_overflow",
        "elementwise_overflow",
        "nan",
    ],
)
def test_any_non_finite_gradient_skips_the_step(mode, gradients):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1)
    variables = [
        keras.Variable(np.ones(len(g), "float32"), name=f"v{i}")
        for i, g in enumerate(gradients)
    ]
    grads = [tf.constant(g, "float32") for g in gradients]

    def step():
        optimizer.apply_gradients(zip(grads, variables))

    _compiled(step, mode)()
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == 0
    for variable in variables:
        np.testing.assert_array_equal(np.array(variable), 1.0)


@pytest.mark.parametrize("mode", MODES)
def test_finite_gradients_that_cancel_are_applied(mode):
    # Same-shape gradients are added elementwise for the check: large values
    # that cancel there must not be mistaken for anything else.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1)
    variables = [keras.Variable([0.0, 0.0]), keras.Variable([0.0, 0.0])]
    grads = [tf.constant([1e38, -2.0]), tf.constant([-1e38, 2.0])]

    def step():
        optimizer.apply_gradients(zip(grads, variables))

    _compiled(step, mode)()
    assert int(optimizer.skipped_steps) == 0
    expected = np.array([-1e38, 2.0], "float32")
    np.testing.assert_array_equal(np.array(variables[0]), expected)
    np.testing.assert_array_equal(np.array(variables[1]), -expected)


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


# --- 3. get_scaled_loss -------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_scaled_loss_keeps_the_loss_dtype_before_and_after_build(dtype):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    loss = tf.constant(1.5, dtype)

    before_build = optimizer.get_scaled_loss(loss)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    after_build = optimizer.get_scaled_loss(loss)

    for scaled in (before_build, after_build):
        assert scaled.dtype == dtype
        assert float(scaled) == 1.5 * 2**15


def test_float16_loss_scales_the_same_before_and_after_build():
    # 3 * 2**15 is above the largest float16: Keras gives inf (float16)
    # before build and 98304 (float32) after; kmp keeps the loss's dtype.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    loss = tf.constant(3.0, "float16")
    before_build = optimizer.get_scaled_loss(loss)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    after_build = optimizer.get_scaled_loss(loss)
    assert before_build.dtype == after_build.dtype == tf.float16
    np.testing.assert_array_equal(np.array(before_build), np.array(after_build))


def test_scaled_loss_of_a_python_float():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    scaled = optimizer.get_scaled_loss(0.5)
    assert scaled.dtype == tf.float32
    assert float(scaled) == 4.0


def test_scaled_loss_reads_the_current_scale_inside_tf_function():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    scaled_loss = tf.function(optimizer.get_scaled_loss)
    loss = tf.constant(1.0)
    assert float(scaled_loss(loss)) == 8.0
    # A skipped step halves the scale; the traced function must see it.
    optimizer.apply_gradients([(tf.constant([INF]), keras.Variable([1.0]))])
    assert float(scaled_loss(loss)) == 4.0


def test_callable_loss_gives_a_callable():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    scaled = optimizer.get_scaled_loss(lambda: tf.constant(1.5))
    assert callable(scaled)
    assert float(scaled()) == 12.0


@pytest.mark.parametrize(
    "loss", [tf.constant(3), 3, "loss"], ids=["int_tensor", "int", "string"]
)
def test_scaled_loss_rejects_a_non_floating_loss(loss):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="'loss' must be"):
        optimizer.get_scaled_loss(loss)


# --- 4. get_unscaled_gradients ------------------------------------------------


def test_unscaled_gradients_keep_each_dtype_and_none():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    grads = (
        tf.constant([8.0, 16.0], "float16"),
        None,
        tf.constant([8.0, 24.0], "bfloat16"),
        tf.constant([8.0, 4.0], "float32"),
        tf.constant([8.0, 2.0], "float64"),
    )
    unscaled = optimizer.get_unscaled_gradients(grads)
    assert isinstance(unscaled, list)
    assert unscaled[1] is None
    expected = [[1.0, 2.0], None, [1.0, 3.0], [1.0, 0.5], [1.0, 0.25]]
    for grad, result, values in zip(grads, unscaled, expected):
        if grad is None:
            continue
        assert result.dtype == grad.dtype
        np.testing.assert_array_equal(
            np.array(tf.cast(result, "float64")), values
        )


def test_unscaled_gradients_accept_a_generator():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4)
    unscaled = optimizer.get_unscaled_gradients(
        tf.constant([v]) for v in (4.0, 8.0)
    )
    assert [float(g[0]) for g in unscaled] == [1.0, 2.0]


def test_unscaled_gradients_keep_indexed_slices():
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
    grads = [tf.constant([1024.0, 2048.0, 512.0], "float16")]
    (unscaled,) = optimizer.get_unscaled_gradients(grads)
    assert unscaled.dtype == tf.float16
    np.testing.assert_array_equal(
        np.array(unscaled),
        np.array([2.0**-15, 2.0**-14, 2.0**-16], "float16"),
    )
    assert np.all(np.array(unscaled) > 0)


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
def test_apply_gradients_leaves_a_variable_without_gradient_alone():
    used, unused = keras.Variable([1.0]), keras.Variable([2.0])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8)
    with tf.GradientTape() as tape:
        scaled_loss = optimizer.get_scaled_loss(tf.reduce_sum(used))
    grads = optimizer.get_unscaled_gradients(
        tape.gradient(scaled_loss, [used, unused])
    )
    assert grads[1] is None
    optimizer.apply_gradients(zip(grads, [used, unused]))
    assert (float(used[0]), float(unused[0])) == (0.5, 2.0)
    assert _optimizer_state(optimizer) == (8.0, 1, 0, 1)


@pytest.mark.parametrize(
    "grads",
    [tf.constant([1.0, 2.0]), 3],
    ids=["single_tensor", "int"],
)
def test_unscaled_gradients_need_a_list(grads):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="'grads' must be a list of gradients"):
        optimizer.get_unscaled_gradients(grads)


def test_unscaled_gradients_reject_integer_gradients():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match=r"'grads\[1\]' must be floating"):
        optimizer.get_unscaled_gradients([tf.constant(1.0), tf.constant(2)])


def test_scaled_loss_names_a_keras_variable_of_the_wrong_dtype():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(
        TypeError,
        match="'loss' must be floating point.*a variable of dtype bool",
    ):
        optimizer.get_scaled_loss(keras.Variable(True))


def _bad_apply_calls():
    """(id, call(optimizer, kernel, bias), error, message) per bad call."""
    ones = tf.ones
    return [
        (
            "string_gradient",
            lambda o, k, b: o.apply_gradients([("x", k)]),
            TypeError,
            r"gradient of '.*kernel' \(position 0\) must be floating point",
        ),
        (
            "integer_gradient",
            lambda o, k, b: o.apply_gradients(
                [(ones((4, 2)), k), (ones((2,), "int32"), b)]
            ),
            TypeError,
            r"gradient of '.*bias' \(position 1\) must be floating.*int32",
        ),
        (
            "wrong_shape",
            lambda o, k, b: o.apply_gradients([(ones((2, 4)), k)]),
            ValueError,
            r"'.*kernel' \(position 0\) must have its variable's shape "
            r"\(4, 2\).*shape \(2, 4\)",
        ),
        (
            "sparse_wrong_shape",
            lambda o, k, b: o.apply_gradients(
                [(tf.IndexedSlices(ones((1, 3)), tf.constant([0])), k)]
            ),
            ValueError,
            r"must have its variable's shape \(4, 2\)"
            r".*values of shape \(1, 3\)",
        ),
        (
            "string_variable",
            lambda o, k, b: o.apply_gradients([(ones((4, 2)), "kernel")]),
            TypeError,
            r"must be a Keras or TensorFlow variable.*position 0: 'kernel'",
        ),
        (
            "not_pairs",
            lambda o, k, b: o.apply_gradients([ones((4, 2)), ones((2,))]),
            TypeError,
            r"\(gradient, variable\) pairs.*position 0: a tensor",
        ),
        (
            "mapping",
            lambda o, k, b: o.apply_gradients({"kernel": ones((4, 2))}),
            TypeError,
            r"'grads_and_vars' must be \(gradient, variable\) pairs",
        ),
        (
            "counts_differ",
            lambda o, k, b: o.apply([ones((4, 2))], [k, b]),
            ValueError,
            "one gradient per variable. Received 1 gradients for 2 variables",
        ),
    ]


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize(
    "call, error, message",
    [case[1:] for case in _bad_apply_calls()],
    ids=[case[0] for case in _bad_apply_calls()],
)
def test_apply_gradients_rejects_bad_input_and_changes_nothing(
    mode, call, error, message
):
    layer = keras.layers.Dense(2)
    layer.build((None, 4))
    kernel, bias = layer.kernel, layer.bias
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    # One good step first, so there are slots and iterations to keep.
    optimizer.apply_gradients(
        [(tf.ones((4, 2)), kernel), (tf.ones((2,)), bias)]
    )
    weights = _values([kernel, bias])

    def bad_step():
        call(optimizer, kernel, bias)

    def attempt():
        with pytest.raises(error, match=message):
            _compiled(bad_step, mode)()

    _assert_unchanged_by(optimizer, attempt)
    _assert_weights_equal(_values([kernel, bias]), weights)
    assert _optimizer_state(optimizer) == (8.0, 1, 0, 1)


def test_apply_gradients_converts_arrays_and_returns_iterations():
    variable = keras.Variable([1.0, 2.0])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8)
    iterations = optimizer.apply_gradients(
        [(np.array([2.0, 4.0], "float32"), variable)]
    )
    np.testing.assert_array_equal(np.array(variable), [0.0, 0.0])
    assert int(iterations) == 1


# --- 5. Both protocols give the float32 reference, bit for bit ----------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fit_matches_the_float32_reference(optimizer_name, mode):
    optimizer = LossScaleOptimizer(OPTIMIZERS[optimizer_name]())
    weights = _fit_weights(optimizer, mode)
    _assert_weights_equal(weights, _reference_weights(optimizer_name, mode))
    assert int(optimizer.iterations) == len(X) // BATCH_SIZE
    assert int(optimizer.skipped_steps) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_custom_loop_matches_the_float32_reference(optimizer_name, mode):
    optimizer = LossScaleOptimizer(OPTIMIZERS[optimizer_name]())
    weights = _loop_weights(optimizer, mode, "contract")
    _assert_weights_equal(weights, _reference_weights(optimizer_name, mode))
    assert int(optimizer.iterations) == len(X) // BATCH_SIZE


@pytest.mark.parametrize("mode", MODES)
def test_keras_style_loop_matches_the_float32_reference(mode):
    # scale_loss -> tape.gradient -> apply_gradients with scaled gradients.
    # SGD, whose update is proportional to the gradient, shows any scale left.
    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"]())
    weights = _loop_weights(optimizer, mode, "keras")
    _assert_weights_equal(weights, _reference_weights("sgd", mode))


def test_keras_style_gradients_from_a_separate_tf_function():
    # scale_loss is traced once; apply_gradients runs eagerly every step and
    # must unscale every step, not only after the call that traced.
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.125), initial_scale=1024
    )

    @tf.function
    def scaled_gradients():
        with tf.GradientTape() as tape:
            scaled_loss = optimizer.scale_loss(tf.reduce_sum(variable))
        return tape.gradient(scaled_loss, [variable])

    values = []
    for _ in range(3):
        optimizer.apply_gradients(zip(scaled_gradients(), [variable]))
        values.append(float(variable[0]))
    assert values == [0.875, 0.75, 0.625]


@pytest.mark.parametrize("mode", MODES)
def test_gradients_may_be_clipped_between_unscaling_and_applying(mode):
    def clip(grads):
        return tf.clip_by_global_norm(grads, 0.05)[0]

    expected = _loop_weights(OPTIMIZERS["sgd"](), mode, "plain", clip)
    # The clipping binds, so clipping scaled gradients would differ.
    unclipped = _reference_weights("sgd", mode)
    assert any(not np.array_equal(a, b) for a, b in zip(expected, unclipped))

    optimizer = LossScaleOptimizer(OPTIMIZERS["sgd"]())
    weights = _loop_weights(optimizer, mode, "contract", clip)
    _assert_weights_equal(weights, expected)


# --- 5b. Applying the update before the check --------------------------------
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
    from kmp import optimizer as kmp_optimizer

    if not apply_first:
        monkeypatch.setattr(kmp_optimizer, "_RESTORE_MAX_ELEMENTS", 0)
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
    from kmp import optimizer as kmp_optimizer

    decide = kmp_optimizer._can_apply_then_restore

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


def test_fit_skips_a_nan_batch_within_steps_per_execution():
    # With steps_per_execution, fit runs several steps in one tf.function
    # (a loop); the skipped step must be undone inside it like any other.
    x = np.concatenate([X, X]).copy()
    x[9, 1] = NAN  # the second of six batches
    y = np.concatenate([Y, Y])
    results = []
    for steps_per_execution in (1, 3):
        optimizer = LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=8
        )
        model = _model()
        model.compile(
            optimizer=optimizer,
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
        model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
        assert int(optimizer.skipped_steps) == 1
        assert int(optimizer.iterations) == 5
        results.append(model.get_weights())
    for one, three in zip(*results):
        assert np.all(np.isfinite(three))
        np.testing.assert_array_equal(three, one)


# --- 5c. Persistent skips -----------------------------------------------------

SKIP_PATHS = ["eager", "first", "in_cond"]


def _skip_stepper(optimizer, path, monkeypatch):
    from kmp import optimizer as kmp_optimizer

    if path == "in_cond":
        monkeypatch.setattr(kmp_optimizer, "_RESTORE_MAX_ELEMENTS", 0)
    variable = keras.Variable([1.0])

    def step(value):
        optimizer.apply_gradients([(tf.constant([value]), variable)])

    return (step if path == "eager" else tf.function(step)), variable


@pytest.mark.parametrize("path", SKIP_PATHS)
def test_persistent_skips_warn_once_with_the_scale(path, monkeypatch):
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), max_consecutive_skips=3
    )
    step, _ = _skip_stepper(optimizer, path, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(INF)
        step(NAN)
        assert not [w for w in caught if w.category is RuntimeWarning]
        step(INF)
        reports = [w for w in caught if w.category is RuntimeWarning]
        assert len(reports) == 1
        message = str(reports[0].message)
        assert "skipped the last 3 steps in a row" in message
        assert "the loss scale is now 4096." in message
        step(1.0)
        for _ in range(3):
            step(INF)
    reports = [w for w in caught if w.category is RuntimeWarning]
    assert len(reports) == 1  # once per optimizer
    assert int(optimizer.skipped_steps) == 6
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("path", SKIP_PATHS)
def test_persistent_skips_raise_when_asked(path, monkeypatch):
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        dynamic=False,
        initial_scale=128,
        max_consecutive_skips=2,
        on_persistent_skips="raise",
    )
    step, variable = _skip_stepper(optimizer, path, monkeypatch)
    step(1.0)
    step(INF)
    # Inside a tf.function TensorFlow re-raises it as an UnknownError whose
    # message starts with the FloatingPointError.
    expected = FloatingPointError if path == "eager" else tf.errors.UnknownError
    with pytest.raises(expected, match="skipped the last 2 steps in a row"):
        try:
            step(INF)
        except expected as error:
            assert "the loss scale is now 128." in str(error)
            raise
    # The step that raised was skipped like any other: nothing changed.
    np.testing.assert_array_equal(np.array(variable), np.float32([0.9]))
    assert int(optimizer.iterations) == 1
    assert int(optimizer.inner_optimizer.iterations) == 1


# --- 6. Dynamic and fixed scales, one step at a time --------------------------


@pytest.mark.parametrize("how", HARNESSES)
def test_dynamic_scale_walk(how):
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=8, dynamic_growth_steps=2
    )
    harness = _Harness(optimizer, how)
    harness.walk(
        [1.0, 1.0, INF, 1.0, NAN, 1.0, 1.0],
        # (scale, counter, skipped_steps, iterations) after each step.
        [
            (8.0, 1, 0, 1),
            (16.0, 0, 0, 2),
            (8.0, 0, 1, 2),
            (8.0, 1, 1, 3),
            (4.0, 0, 2, 3),
            (4.0, 1, 2, 4),
            (8.0, 0, 2, 5),
        ],
    )


@pytest.mark.parametrize("how", FEWER_HARNESSES)
def test_scale_halves_no_lower_than_one(how):
    # Keras halves on to 0.125 here, and a scale of 0 would write NaN.
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=4)
    harness = _Harness(optimizer, how)
    harness.walk(
        [INF] * 5 + [1.0],
        [
            (2.0, 0, 1, 0),
            (1.0, 0, 2, 0),
            (1.0, 0, 3, 0),
            (1.0, 0, 4, 0),
            (1.0, 0, 5, 0),
            (1.0, 1, 5, 1),
        ],
    )


@pytest.mark.parametrize("how", ["loop_eager", "loop_jit", "fit_tf_function"])
def test_scale_does_not_grow_past_the_largest_float32(how):
    # Keras doubles 2**127 to inf. A tiny loss keeps 2**127 * loss finite.
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=2.0**127,
        dynamic_growth_steps=1,
    )
    harness = _Harness(optimizer, how)
    tiny = 2.0**-100
    harness.walk(
        [tiny, tiny, tiny],
        [(2.0**127, 0, 0, 1), (2.0**127, 0, 0, 2), (2.0**127, 0, 0, 3)],
    )


@pytest.mark.parametrize("how", FEWER_HARNESSES)
def test_fixed_scale_never_changes_and_still_skips(how):
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), dynamic=False, initial_scale=64
    )
    harness = _Harness(optimizer, how)
    harness.walk(
        [1.0, INF, 1.0, NAN, 1.0],
        [
            (64.0, None, 0, 1),
            (64.0, None, 1, 1),
            (64.0, None, 1, 2),
            (64.0, None, 2, 2),
            (64.0, None, 2, 3),
        ],
    )


# --- 7. model.compile ---------------------------------------------------------


def test_compile_keeps_a_kmp_optimizer_under_mixed_float16():
    kmp.set_global_policy("mixed_float16")
    model = _model()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer


def test_compile_string_optimizer_under_mixed_float16_scales_the_loss():
    kmp.set_global_policy("mixed_float16")
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    optimizer = model.optimizer
    assert isinstance(optimizer, LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert optimizer.dynamic and optimizer.initial_scale == 2.0**15

    history = model.fit(
        X, Y, batch_size=BATCH_SIZE, epochs=4, shuffle=False, verbose=0
    )
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    steps = 4 * len(X) // BATCH_SIZE
    # Every step either counted towards growth or was skipped and halved.
    assert int(optimizer.iterations) + int(optimizer.skipped_steps) == steps
    assert _optimizer_state(optimizer)[:2] != (2.0**15, 0)


def _tiny_loss(y_true, y_pred):
    """A loss whose gradient (1e-8 / batch) underflows to 0 in float16."""
    del y_true
    return 1e-8 * keras.ops.mean(keras.ops.cast(y_pred, "float32"))


def _kernel_after_one_fit_step(optimizer, **compile_kwargs):
    """One fit step of a float16 Dense(1) with a zero kernel on `_tiny_loss`."""
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
        ]
    )
    model.compile(optimizer=optimizer, loss=_tiny_loss, **compile_kwargs)
    model.fit(X[:BATCH_SIZE], Y[:BATCH_SIZE, :1], batch_size=BATCH_SIZE)
    return np.array(model.layers[0].kernel)[:, 0], model.optimizer


@pytest.mark.parametrize(
    "optimizer, learning_rate",
    [
        (lambda: LossScaleOptimizer(keras.optimizers.SGD(1.0)), 1.0),
        ("sgd", 0.01),
    ],
    ids=["explicit", "string"],
)
def test_fit_scales_the_loss_so_float16_gradients_survive(
    optimizer, learning_rate
):
    # The kernel's gradient is 1e-8 times each input's batch mean: float16
    # gradients of the output underflow to 0 unless the loss is scaled.
    true_gradient = 1e-8 * X[:BATCH_SIZE].astype("float64").mean(axis=0)
    if callable(optimizer):
        optimizer = optimizer()
    kernel, used = _kernel_after_one_fit_step(optimizer)
    assert isinstance(used, LossScaleOptimizer)
    assert int(used.iterations) == 1 and int(used.skipped_steps) == 0
    np.testing.assert_allclose(
        kernel, -learning_rate * true_gradient, rtol=1e-2
    )

    # Without loss scaling the same step leaves the kernel at zero.
    plain, _ = _kernel_after_one_fit_step(
        keras.optimizers.SGD(1.0), auto_scale_loss=False
    )
    np.testing.assert_array_equal(plain, np.zeros(4, "float32"))


def test_compile_does_not_wrap_with_auto_scale_loss_false():
    kmp.set_global_policy("mixed_float16")
    model = _model()
    adam = keras.optimizers.Adam(0.01)
    model.compile(optimizer=adam, loss="mse", auto_scale_loss=False)
    assert model.optimizer is adam


def test_compile_does_not_wrap_under_float32():
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


# --- 8. Serialization ---------------------------------------------------------


def _dynamic_optimizer():
    return LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=256,
        dynamic_growth_steps=7,
        name="dynamic_lso",
    )


def _fixed_optimizer():
    return LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=32
    )


CONFIGURED = {"dynamic": _dynamic_optimizer, "fixed": _fixed_optimizer}


def _assert_same_settings(restored, original):
    assert type(restored) is LossScaleOptimizer
    assert restored.get_config() == original.get_config()
    assert restored.name == original.name
    assert restored.dynamic == original.dynamic
    assert restored.initial_scale == original.initial_scale
    assert restored.dynamic_growth_steps == original.dynamic_growth_steps
    assert float(restored.loss_scale) == original.initial_scale
    inner, original_inner = (
        restored.inner_optimizer,
        original.inner_optimizer,
    )
    assert type(inner) is type(original_inner)
    assert inner.get_config() == original_inner.get_config()


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_get_config_from_config_round_trip(kind):
    original = CONFIGURED[kind]()
    config = original.get_config()
    assert config["dynamic"] is (kind == "dynamic")
    assert config["initial_scale"] == original.initial_scale
    assert config["dynamic_growth_steps"] == original.dynamic_growth_steps
    _assert_same_settings(LossScaleOptimizer.from_config(config), original)


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_keras_optimizers_serialize_round_trip(kind):
    original = CONFIGURED[kind]()
    restored = keras.optimizers.deserialize(
        keras.optimizers.serialize(original)
    )
    _assert_same_settings(restored, original)


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_serialize_keras_object_round_trip(kind):
    original = CONFIGURED[kind]()
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(original)
    )
    _assert_same_settings(restored, original)


def _trained_harness(how):
    """A harness whose optimizer state differs from its initial state."""
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=64, dynamic_growth_steps=2
    )
    harness = _Harness(optimizer, how)
    harness.train([1.0, 1.0, 1.0, 1.0, INF, 1.0])
    assert _optimizer_state(optimizer) == (128.0, 1, 1, 5)
    return harness


def test_checkpoint_saves_and_restores_the_scale_and_slots(tmp_path):
    trained = _trained_harness("loop_tf_function")
    checkpoint = tf.train.Checkpoint(
        model=trained.model, optimizer=trained.optimizer
    )
    path = checkpoint.save(str(tmp_path / "ckpt"))

    fresh = _Harness(
        LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64,
            dynamic_growth_steps=2,
        ),
        "loop_tf_function",
    )
    assert _optimizer_state(fresh.optimizer) == (64.0, 0, 0, 0)
    status = tf.train.Checkpoint(
        model=fresh.model, optimizer=fresh.optimizer
    ).restore(path)
    status.assert_existing_objects_matched()

    assert _optimizer_state(fresh.optimizer) == (128.0, 1, 1, 5)
    _assert_weights_equal(fresh.snapshot(), trained.snapshot())
    # Training goes on exactly as it would have without the checkpoint.
    trained.train([1.0])
    fresh.train([1.0])
    assert _optimizer_state(fresh.optimizer) == (256.0, 0, 1, 6)
    _assert_weights_equal(fresh.snapshot(), trained.snapshot())


def _load_model_without_skipping(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    messages = [str(w.message) for w in caught]
    assert not any("Skipping variable loading" in m for m in messages), messages
    return loaded


def _fit_steps(model, inputs_per_step):
    for inputs in inputs_per_step:
        model.fit(inputs, Y[:BATCH_SIZE], batch_size=BATCH_SIZE, verbose=0)


_X_FINITE = X[:BATCH_SIZE]
_X_INF = np.where(np.arange(BATCH_SIZE)[:, None] == 0, np.inf, _X_FINITE)
_X_INF = _X_INF.astype("float32")


def test_model_save_and_load_restore_an_explicit_optimizer(tmp_path):
    model = _model()
    model.compile(
        optimizer=LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64,
            dynamic_growth_steps=2,
        ),
        loss="mse",
    )
    _fit_steps(model, [_X_FINITE] * 4 + [_X_INF, _X_FINITE])
    assert _optimizer_state(model.optimizer) == (128.0, 1, 1, 5)
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = _load_model_without_skipping(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert loaded.optimizer.dynamic_growth_steps == 2
    assert _optimizer_state(loaded.optimizer) == (128.0, 1, 1, 5)
    _assert_weights_equal(
        _values(loaded.optimizer.variables), _values(model.optimizer.variables)
    )
    # Training continues where it stopped.
    _fit_steps(model, [_X_FINITE])
    _fit_steps(loaded, [_X_FINITE])
    assert _optimizer_state(loaded.optimizer) == (256.0, 0, 1, 6)
    _assert_weights_equal(loaded.get_weights(), model.get_weights())


def test_model_compiled_with_adam_under_mixed_float16_loads_under_float32(
    tmp_path,
):
    # Keras 3.15 loads a plain Adam here and warns that it skipped the
    # saved optimizer variables: the scale and counter are lost.
    kmp.set_global_policy("mixed_float16")
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    _fit_steps(model, [_X_FINITE, _X_FINITE, _X_INF, _X_FINITE])
    state = _optimizer_state(model.optimizer)
    assert state[2] >= 1 and state[:2] != (2.0**15, 0)
    path = str(tmp_path / "model.keras")
    model.save(path)

    kmp.set_global_policy("float32")
    loaded = _load_model_without_skipping(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert _optimizer_state(loaded.optimizer) == state
    _assert_weights_equal(
        _values(loaded.optimizer.variables), _values(model.optimizer.variables)
    )
    scale, counter, skipped, iterations = state
    _fit_steps(loaded, [_X_FINITE])
    after = _optimizer_state(loaded.optimizer)
    assert after[1:] in [
        (counter + 1, skipped, iterations + 1),  # applied
        (0, skipped + 1, iterations),  # skipped (float16 overflow)
    ]


@pytest.mark.parametrize("config", [{}, None, {"initial_scale": 8.0}])
def test_from_config_needs_a_config_with_the_inner_optimizer(config):
    with pytest.raises(ValueError, match="'config' must be a dict with"):
        LossScaleOptimizer.from_config(config)


# --- 9. End to end under mixed_float16 ----------------------------------------


@functools.lru_cache(maxsize=None)
def _digits():
    digits = load_digits()
    x = (digits.data[:640] / 16.0).astype("float32")
    y = digits.target[:640].astype("int32")
    return x, y


def _digits_model():
    """Dense -> Dense -> Dense logits -> float32 softmax, under the policy."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def _digits_loss(model):
    x, y = _digits()
    return float(keras.losses.SparseCategoricalCrossentropy()(y, model(x)))


def test_end_to_end_fit_under_mixed_float16():
    kmp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = _digits_model()
    assert model.layers[0].compute_dtype == "float16"
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
    )
    assert isinstance(model.optimizer, LossScaleOptimizer)
    x, y = _digits()
    loss_before = _digits_loss(model)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert _digits_loss(model) < loss_before
    assert model(x[:4]).dtype == "float32"
    assert int(model.optimizer.iterations) > 0


def test_end_to_end_custom_loop_under_mixed_float16():
    kmp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = _digits_model()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            probabilities = model(x, training=True)
            loss = loss_fn(y, probabilities)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return probabilities, grads

    x, y = _digits()
    loss_before = _digits_loss(model)
    for start in range(0, len(x), 32):
        probabilities, grads = train_step(
            x[start : start + 32], y[start : start + 32]
        )
    assert _digits_loss(model) < loss_before
    assert probabilities.dtype == tf.float32
    assert all(g.dtype == tf.float32 for g in grads)
    assert int(optimizer.iterations) + int(optimizer.skipped_steps) == 20
    assert int(optimizer.iterations) > 0
