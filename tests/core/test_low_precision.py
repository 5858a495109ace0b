"""Tests for kmp.LowPrecisionOptimizer: float32 updates of bfloat16 weights.

On every backend: the arithmetic first (Kahan compensation follows float32
within one bfloat16 ulp, stochastic rounding over a stream of updates is
unbiased), then that any inner optimizer's update is its own (bit for bit
on float32 variables), loss scaling and the documented custom loops,
distribution (every replica or device rounds alike), a small classifier
that learns in bfloat16 where Keras's own update stalls, clipping, and
errors. TensorFlow's `tf.function`/XLA paths and `MirroredStrategy`, and
JAX's `DataParallel`, carry their backend's marker. Rounding itself is
tested in `low_bit/test_rounding.py`, saving and resuming in
`test_low_precision_resume.py`.
"""

import keras
import ml_dtypes
import numpy as np
import pytest

import kmp
from kmp.core.low_precision import LowPrecisionOptimizer
from tests.support import backends
from tests.support import training
from tests.support.backends import MODES
from tests.support.low_precision import bfloat16_model
from tests.support.low_precision import digits_like
from tests.support.low_precision import logits_loss
from tests.support.low_precision import numpy_of
from tests.support.low_precision import state
from tests.support.low_precision import stepper

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

BF16 = ml_dtypes.bfloat16
_RNG = np.random.default_rng(0)
ops = keras.ops


def _ulp(values):
    """The gap between a bfloat16 value and the next one away from zero."""
    return np.spacing(np.abs(values).astype(BF16)).astype("float64")


def _run_stream(optimizer, variable, updates):
    """Applies `-updates[i]` as the gradient, for every row i, in one
    compiled loop (eagerly on torch)."""
    if backends.TENSORFLOW:
        tf = backends.tensorflow()

        @tf.function
        def run(updates):
            for i in tf.range(tf.shape(updates)[0]):
                optimizer.apply([-updates[i]], [variable])

        run(tf.constant(updates))
    elif backends.JAX:
        import jax

        updates = ops.convert_to_tensor(updates)

        def body(i, state):
            values, optimizer_values = state
            new, optimizer_values = optimizer.stateless_apply(
                optimizer_values, [-updates[i]], values
            )
            return list(new), list(optimizer_values)

        state = ([variable.value], [v.value for v in optimizer.variables])
        loop = jax.jit(lambda s: jax.lax.fori_loop(0, len(updates), body, s))
        (value,), optimizer_values = loop(state)
        variable.assign(value)
        for each, value in zip(optimizer.variables, optimizer_values):
            each.assign(value)
    else:
        for update in ops.convert_to_tensor(updates):
            optimizer.apply([-update], [variable])


def _stream(rounding, updates, initial, seed=3):
    """Adds `updates` (steps x n) to bfloat16 weights through SGD(1)."""
    variable = keras.Variable(initial, dtype="bfloat16")
    optimizer = keras.optimizers.SGD(1.0)
    if rounding is not None:
        optimizer = LowPrecisionOptimizer(optimizer, rounding, seed=seed)
    optimizer.build([variable])
    _run_stream(optimizer, variable, updates)
    return numpy_of(variable, "float64")


def _float32_sum(updates, initial):
    total = initial.astype(BF16).astype("float32")
    for update in updates:
        total = total + update  # float32, rounded at every step.
    return total.astype("float64")


# --- The arithmetic -----------------------------------------------------------

# torch applies each step eagerly: fewer of them (sums scale with STEPS).
STEPS = 2_500 if backends.TORCH else 10_000
INITIAL = _RNG.uniform(0.9, 1.1, 64).astype("float32")
STREAMS = {  # The same data everywhere, the first STEPS rows used.
    "uniform": _RNG.uniform(0, 2e-4, (10_000, 64)).astype("float32")[:STEPS],
    "signed": _RNG.normal(1e-5, 1e-4, (10_000, 64)).astype("float32")[:STEPS],
}


@pytest.mark.parametrize("stream", list(STREAMS))
def test_kahan_follows_float32_within_one_ulp(stream):
    updates = STREAMS[stream]
    want = _float32_sum(updates, INITIAL)
    kahan = _stream("kahan", updates, INITIAL)
    np.testing.assert_array_less(np.abs(kahan - want), _ulp(want))
    # Without compensation most of the stream is rounded away.
    plain = _stream(None, updates, INITIAL)
    assert np.median(np.abs(plain - want) / _ulp(want)) > 10 * STEPS / 10_000


def test_stochastic_stream_is_unbiased():
    updates = STREAMS["uniform"]
    want = _float32_sum(updates, INITIAL)
    got = _stream("stochastic", updates, INITIAL)
    errors = (got - want) / _ulp(want)
    # Each weight ends sqrt(10000 * p(1 - p)) ~ 11 ulps from float32 at
    # random (p = 1e-4 / ulp): the mean of 64 is within 0.7 ulp, 6 sigma 4.2.
    assert abs(errors.mean()) < 4.5
    plain = _stream(None, updates, INITIAL)
    assert np.mean((plain - want) / _ulp(want)) < -50 * STEPS / 10_000


# --- Any inner optimizer's own update -----------------------------------------

SHAPES = [(7, 5), (5,)]
WEIGHTS = [_RNG.normal(size=shape).astype("float32") for shape in SHAPES]
GRADIENTS = [
    [
        (_RNG.normal(size=shape) * 10 ** _RNG.uniform(-3, 1)).astype("float32")
        for shape in SHAPES
    ]
    for _ in range(5)
]
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_nesterov": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, nesterov=True
    ),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_amsgrad_clipnorm": lambda: keras.optimizers.Adam(
        0.01, amsgrad=True, clipnorm=0.5
    ),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(
        0.01, momentum=0.5, centered=True, global_clipnorm=1.0
    ),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.01, clipvalue=0.1),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.1),
    "adafactor": lambda: keras.optimizers.Adafactor(0.1),
    "muon": lambda: keras.optimizers.Muon(0.01, weight_decay=0.1),
    "fused_adam_schedule": lambda: kmp.FusedAdam(
        keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
    ),
}
TENSORFLOW_ONLY_OPTIMIZERS = ("fused_adam_schedule",)


def _train(
    optimizer,
    mode=backends.DEFAULT_FIT_MODE,
    dtype="float32",
    grads=GRADIENTS,
):
    variables = [keras.Variable(w, dtype=dtype) for w in WEIGHTS]
    optimizer.build(variables)
    step = stepper(optimizer, variables, mode)
    for gradients in grads:
        step([backends.tensor(g, dtype) for g in gradients])
    return [numpy_of(v) for v in variables]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.tensorflow)
        if name in TENSORFLOW_ONLY_OPTIMIZERS
        else name
        for name in OPTIMIZERS
    ],
)
def test_float32_variables_get_the_inner_update_bit_for_bit(name):
    if name == "muon" and kmp.core.backend.keras_version() < (3, 15):
        pytest.skip(
            "Muon before Keras 3.15 reads `.path` of the variables it "
            "updates, which kmp's wrapper hands it as TensorFlow variables"
        )
    make = OPTIMIZERS[name]
    if name.startswith("fused"):  # It runs Keras's Adam update, unfused.
        want = _train(
            keras.optimizers.Adam(
                keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
            )
        )
    else:
        want = _train(make())
    for rounding in ("kahan", "stochastic"):
        got = _train(LowPrecisionOptimizer(make(), rounding))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert not np.array_equal(want[0], WEIGHTS[0])


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_rounds_alike(mode):
    def train(rounding, mode):
        return _train(
            LowPrecisionOptimizer(
                keras.optimizers.Adam(0.01), rounding, seed=5
            ),
            mode,
            "bfloat16",
        )

    for rounding in ("kahan", "stochastic"):
        want = train(rounding, "eager")
        for got, w in zip(train(rounding, mode), want):
            # XLA may fuse a multiply and an add: a float32 rounding apart,
            # which can move a bfloat16 result by one ulp, and the steps
            # after it by one more.
            np.testing.assert_allclose(
                got.astype("float32"), w.astype("float32"), rtol=2**-6
            )


@pytest.mark.tensorflow
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_compiled_update_rounds_like_the_plain_one(rounding, monkeypatch):
    from kmp.core.tensorflow import low_precision as tf_low_precision

    def train():
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(0.01), rounding, slot_dtype="bfloat16", seed=5
        )
        return _train(optimizer, "tf_function", "bfloat16"), optimizer

    want, _ = train()
    monkeypatch.setattr(tf_low_precision, "COMPILE_MIN_ELEMENTS", 0)
    got, optimizer = train()
    assert len(optimizer._compiled) == len(SHAPES)
    for g, w in zip(got, want):
        # XLA may fuse a multiply and an add: one float32 rounding apart.
        np.testing.assert_allclose(
            g.astype("float32"), w.astype("float32"), rtol=2**-7
        )


@pytest.mark.parametrize("policy", ["bfloat16", "mixed_bfloat16"])
def test_slots_in_bfloat16_with_float32_arithmetic(policy):
    with kmp.policy_scope(policy):
        layer = keras.layers.Dense(3)
        layer.build((None, 4))
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(0.01), slot_dtype="bfloat16"
    )
    optimizer.build(layer.trainable_variables)
    slots = optimizer.inner_optimizer.variables[2:]
    assert [v.dtype for v in slots] == ["bfloat16"] * 4
    kahan = [v for v in optimizer.variables if "compensation" in v.path]
    expected = 2 if policy == "bfloat16" else 0
    assert [v.dtype for v in kahan] == ["bfloat16"] * expected
    # Keras's default: slots in each variable's dtype.
    default = LowPrecisionOptimizer(keras.optimizers.Adam(), slot_dtype=None)
    default.build(layer.trainable_variables)
    assert {v.dtype for v in default.inner_optimizer.variables[2:]} == {
        layer.kernel.dtype
    }


def test_bfloat16_slots_follow_float32_adam_closely():
    want = _train(keras.optimizers.Adam(0.01))
    got = _train(
        LowPrecisionOptimizer(
            keras.optimizers.Adam(0.01), slot_dtype="bfloat16"
        )
    )
    for g, w, start in zip(got, want, WEIGHTS):
        # Within 2% of the distance travelled.
        np.testing.assert_allclose(
            g - start, w - start, atol=0.02 * np.abs(w - start).max()
        )


def test_bfloat16_training_learns_where_keras_alone_does_not():
    # Keras's Adam on bfloat16 variables computes beta_2 = 0.999 in
    # bfloat16, where it is 1.0: its bias correction is then 0, and no
    # variable ever moves.
    plain = _train(keras.optimizers.Adam(0.01), dtype="bfloat16")
    for value, start in zip(plain, WEIGHTS):
        np.testing.assert_array_equal(value, start.astype(BF16))
    wrapped = _train(
        LowPrecisionOptimizer(keras.optimizers.Adam(0.01)), dtype="bfloat16"
    )
    want = _train(keras.optimizers.Adam(0.01))
    for value, w in zip(wrapped, want):
        np.testing.assert_allclose(value.astype("float32"), w, atol=2e-2)


@pytest.mark.parametrize("rounding", ["kahan", "stochastic", "nearest"])
def test_fit_under_a_pure_bfloat16_policy(rounding):
    kmp.set_global_policy("bfloat16")
    x, y = digits_like()
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), rounding, seed=0
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert history.history["loss"][-1] < 0.8 * history.history["loss"][0]
    assert int(optimizer.iterations) == 24
    assert {v.dtype for v in model.trainable_variables} == {"bfloat16"}


# --- Loss scaling -------------------------------------------------------------


def _float16_model():
    kmp.set_global_policy("float16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )
    kmp.set_global_policy(None)
    return model


def test_inside_a_loss_scale_optimizer_float16_trains_and_skips_exactly(
    compiled,
):
    model = _float16_model()
    # float16 slots would underflow: Adam's second moment is a gradient
    # squared (Keras's float16 Adam diverges on this model).
    inner = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), slot_dtype="bfloat16", seed=0
    )
    optimizer = kmp.LossScaleOptimizer(inner, initial_scale=2.0**10)
    x = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert any("compensation" in v.path for v in optimizer.variables)

    step = stepper(
        optimizer, model.trainable_variables, backends.DEFAULT_FIT_MODE
    )
    finite = [
        ops.ones(v.shape, v.dtype) * 1e-3 for v in model.trainable_variables
    ]
    step(finite)
    before = state(model, optimizer)
    skipped = int(optimizer.skipped_steps)
    bad = [g * np.inf if i == 1 else g for i, g in enumerate(finite)]
    step(bad)
    after = state(model, optimizer)
    # Only the loss-scale optimizer's own scale and skip counts change.
    changed = [
        v.path
        for v, b, a in zip(
            model.trainable_variables + optimizer.variables,
            before,
            after,
        )
        if not np.array_equal(b, a)
    ]
    assert changed == [
        "loss_scale_optimizer/step_counter",
        "loss_scale_optimizer/dynamic_scale",
        "loss_scale_optimizer/skipped_steps",
        "loss_scale_optimizer/consecutive_skips",
    ]
    assert int(optimizer.skipped_steps) == skipped + 1


@pytest.mark.parametrize("mode", MODES)
def test_custom_loops_with_loss_scaling_give_the_same_weights(mode):
    """The documented loops: `tf.GradientTape`; on JAX `jax.grad` over
    `stateless_call`, then `stateless_scale_loss`, `stateless_unscale_
    gradients` and `stateless_apply` in one `jax.jit`; on torch
    `loss.backward()`. A power-of-two scale changes no gradient, so
    LossScaleOptimizer(LowPrecisionOptimizer) gives the wrapped one's
    weights, slots and compensation bit for bit."""
    x, y = digits_like()
    results = []
    for recipe in ("plain", "contract"):
        model = bfloat16_model()
        low = LowPrecisionOptimizer(keras.optimizers.Adam(1e-2), seed=3)
        optimizer = low
        if recipe == "contract":
            optimizer = kmp.LossScaleOptimizer(
                low, dynamic=False, initial_scale=16
            )
        step = training.loop_step(model, optimizer, logits_loss(), recipe, mode)
        for start in range(0, 96, 32):
            rows = slice(start, start + 32)
            step(backends.tensor(x[rows]), backends.tensor(y[rows], "int32"))
        assert int(low.iterations) == 3
        results.append(state(model, low))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(results[0][0], state(bfloat16_model(), low)[0])


# --- Saving and resuming ------------------------------------------------------


# --- Distribution -------------------------------------------------------------


@pytest.mark.tensorflow
@pytest.mark.parametrize(
    "rounding, compiled",
    [("kahan", "plain"), ("stochastic", "plain"), ("kahan", "compiled")],
    indirect=["compiled"],
)
def test_every_replica_rounds_identically(two_replicas, rounding, compiled):
    tf = backends.tensorflow()
    x, y = digits_like()
    with two_replicas.scope():
        model = bfloat16_model()
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2), rounding, seed=4
        )
        optimizer.build(model.trainable_variables)
    loss_fn = logits_loss(reduction="sum")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / 96.0
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    dataset = two_replicas.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    )

    @tf.function
    def step(x, y):
        two_replicas.run(replica_step, args=(x, y))

    start = [v.numpy() for v in model.trainable_variables]
    for batch in dataset:
        step(*batch)
    assert optimizer.iterations.numpy() == 3
    for variable, first in zip(
        model.trainable_variables + optimizer.variables,
        start + [None] * len(optimizer.variables),
    ):
        copies = [c.numpy() for c in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
        if first is not None:
            assert not np.array_equal(copies[0], first)


@pytest.mark.jax
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_every_device_rounds_identically_under_data_parallel(rounding):
    import jax

    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip(
            "needs 2 CPU devices: XLA_FLAGS="
            "--xla_force_host_platform_device_count=2 (tests/conftest.py)"
        )
    distribution = keras.distribution.DataParallel(devices=devices[:2])
    x, y = digits_like()
    with distribution.scope():
        model = bfloat16_model()
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2), rounding, seed=4
        )
        model.compile(optimizer=optimizer, loss=logits_loss())
        start = [numpy_of(v) for v in model.trainable_variables]
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert int(optimizer.iterations) == 3
    assert len(model.layers[0].kernel.value.sharding.device_set) == 2
    for variable in model.trainable_variables + optimizer.variables:
        copies = [np.asarray(s.data) for s in variable.value.addressable_shards]
        assert len(copies) == 2, variable.path
        assert copies[0].tobytes() == copies[1].tobytes(), variable.path
    for variable, first in zip(model.trainable_variables, start):
        assert not np.array_equal(numpy_of(variable), first), variable.path


# --- Learning where Keras's update stalls -------------------------------------


def test_a_digits_classifier_learns_in_bfloat16_where_keras_update_stalls():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")

    def accuracy(optimizer):
        with kmp.policy_scope("bfloat16"):
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(64, activation="relu"),
                    keras.layers.Dense(10),
                    keras.layers.Activation("linear", dtype="float32"),
                ]
            )
        model.compile(optimizer=optimizer, loss=logits_loss())
        # 20 steps on 640 images: the least that still separates the two
        # (measured 0.78-0.80 on every backend, where the stall gives
        # 0.03-0.08); 66 steps on 1400 gave 0.87.
        model.fit(x[:640], y[:640], batch_size=64, epochs=2, verbose=0)
        predicted = np.argmax(model.predict(x[1400:], verbose=0), axis=-1)
        return np.mean(predicted == y[1400:])

    # Keras's Adam on bfloat16 weights: beta_2 rounds to 1.0, so the step
    # size is 0 and the weights never move.
    assert accuracy(keras.optimizers.Adam(1e-2)) < 0.3
    adam = keras.optimizers.Adam
    assert accuracy(LowPrecisionOptimizer(adam(1e-2))) > 0.7
    assert accuracy(LowPrecisionOptimizer(adam(1e-2), "stochastic")) > 0.7


# --- Clipping -----------------------------------------------------------------


@pytest.mark.parametrize("mode", backends.STATEFUL_MODES)
def test_global_clipnorm_of_bfloat16_and_float32_gradients(mode):
    # Issue 21: a bfloat16 model with a float32 output layer died inside
    # Keras's global norm, which adds squared norms of two dtypes. The
    # norm is taken in float32: as Keras does for float32 gradients.
    grads = GRADIENTS[0]
    norm = np.sqrt(sum(np.sum(np.square(g, dtype="float64")) for g in grads))

    def sgd():
        return keras.optimizers.SGD(0.1, global_clipnorm=float(norm) / 2)

    weights = [keras.Variable(WEIGHTS[0], dtype="bfloat16")]
    weights.append(keras.Variable(WEIGHTS[1]))
    inputs = [backends.tensor(grads[0], "bfloat16"), backends.tensor(grads[1])]
    optimizer = LowPrecisionOptimizer(sgd(), seed=1)
    optimizer.build(weights)
    stepper(optimizer, weights, mode)(inputs)

    reference = [
        keras.Variable(numpy_of(weights[0], "float32")),
        keras.Variable(WEIGHTS[1]),
    ]
    reference[0].assign(WEIGHTS[0].astype(BF16).astype("float32"))
    plain = sgd()
    plain.build(reference)
    stepper(plain, reference, mode)([ops.cast(inputs[0], "float32"), inputs[1]])
    np.testing.assert_array_equal(numpy_of(weights[1]), numpy_of(reference[1]))
    np.testing.assert_array_equal(
        numpy_of(weights[0]), numpy_of(reference[0]).astype(BF16)
    )
    unclipped = WEIGHTS[1] - 0.1 * grads[1]
    assert not np.allclose(numpy_of(weights[1]), unclipped)


# --- Bad input is refused at the call -----------------------------------------


@pytest.mark.parametrize(
    "make_inner, kwargs, error, fragment",
    [
        (lambda: "adam", {}, TypeError, "inner_optimizer='adam' of type str"),
        (
            lambda: kmp.LossScaleOptimizer(keras.optimizers.Adam()),
            {},
            TypeError,
            "kmp.LossScaleOptimizer(kmp.LowPrecisionOptimizer(...))",
        ),
        (
            lambda: LowPrecisionOptimizer(keras.optimizers.Adam()),
            {},
            TypeError,
            "must be a plain Keras optimizer",
        ),
        (
            lambda: keras.optimizers.Adam(use_ema=True),
            {},
            ValueError,
            "use_ema=True",
        ),
        (
            lambda: keras.optimizers.SGD(gradient_accumulation_steps=2),
            {},
            ValueError,
            "gradient_accumulation_steps=2",
        ),
        (
            lambda: keras.optimizers.SGD(loss_scale_factor=8.0),
            {},
            ValueError,
            "wrap in kmp.LossScaleOptimizer instead",
        ),
        (
            keras.optimizers.Adam,
            {"rounding": "up"},
            ValueError,
            "rounding='up'",
        ),
        (keras.optimizers.Adam, {"rounding": 1}, TypeError, "rounding=1"),
        (
            keras.optimizers.Adam,
            {"slot_dtype": "int8"},
            ValueError,
            "'slot_dtype' must be one of None, 'bfloat16', 'float16', "
            "'float32', '8bit', '4bit', 'float8'. Received: slot_dtype='int8'",
        ),
        (
            keras.optimizers.Adam,
            {"slot_dtype": backends.native_dtype("bfloat16")},
            TypeError,
            "'slot_dtype' must be one of None, 'bfloat16', 'float16', "
            "'float32', '8bit', '4bit', 'float8'. Received: slot_dtype=",
        ),
        (keras.optimizers.Adam, {"seed": -1}, ValueError, "seed=-1"),
        (keras.optimizers.Adam, {"seed": 2**63}, ValueError, "2**63 - 1"),
        (keras.optimizers.Adam, {"seed": 1.5}, TypeError, "seed=1.5"),
        (keras.optimizers.Adam, {"seed": True}, TypeError, "seed=True"),
    ],
)
def test_bad_arguments_are_refused(make_inner, kwargs, error, fragment):
    with pytest.raises(error) as info:
        LowPrecisionOptimizer(make_inner(), **kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "value",
    [np.float16(np.inf), 1e39, float("nan"), 1e-50, "fast"],
    ids=["float16_inf", "beyond_float32", "nan", "to_zero", "str"],
)
def test_learning_rate_assignment_is_checked_as_applied(value):
    """As kmp.LossScaleOptimizer's: the rate goes to a float32 variable."""
    inner = keras.optimizers.SGD(0.25)
    optimizer = LowPrecisionOptimizer(inner)
    with pytest.raises((TypeError, ValueError), match="'learning_rate' must"):
        optimizer.learning_rate = value
    assert float(np.array(inner.learning_rate)) == 0.25
    optimizer.learning_rate = np.float16(0.5)
    assert float(np.array(inner.learning_rate)) == 0.5


def test_a_built_inner_optimizer_is_refused():
    inner = keras.optimizers.Adam()
    inner.build([keras.Variable(np.ones(2, "float32"))])
    with pytest.raises(ValueError, match="must not be built yet"):
        LowPrecisionOptimizer(inner)


def test_a_config_without_inner_optimizer_is_refused():
    with pytest.raises(ValueError, match="'inner_optimizer'"):
        LowPrecisionOptimizer.from_config({"rounding": "kahan"})


@pytest.mark.parametrize("mode", backends.modes("eager", "tf_function"))
def test_a_bad_gradient_is_refused_before_any_update(mode):
    first = keras.Variable(np.ones(3), dtype="bfloat16", name="first")
    second = keras.Variable(np.ones((2, 2)), dtype="bfloat16", name="second")
    optimizer = LowPrecisionOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build([first, second])

    def step(bad):
        optimizer.apply([ops.ones(3), bad], [first, second])

    if mode == "tf_function":
        step = backends.tensorflow().function(step)
    with pytest.raises(ValueError, match=r"'second' \(position 1\) must have"):
        step(ops.ones((2, 1)))
    with pytest.raises(TypeError, match=r"'second' \(position 1\) must be"):
        step(ops.ones((2, 2), "int32"))
    assert int(optimizer.iterations) == 0
    np.testing.assert_array_equal(numpy_of(first), np.ones(3, BF16))
