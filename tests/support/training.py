"""Helpers shared by the LossScaleOptimizer tests on a single device.

Not a test module: a tiny float32 model with fixed initial weights, the
float32 references it trains to, the two custom-loop recipes, and a harness
that trains one step at a time and checks the optimizer's state after each.
"""

import functools
import warnings

import keras
import numpy as np
import tensorflow as tf

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


def model():
    """A tiny float32 regression model with the shared initial weights."""
    result = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    result.set_weights(INITIAL_WEIGHTS)
    return result


def compile_kwargs(mode):
    return {
        "eager": {"run_eagerly": True},
        "tf_function": {},
        "jit": {"jit_compile": True},
    }[mode]


def compiled(function, mode):
    if mode == "eager":
        return function
    return tf.function(function, jit_compile=mode == "jit")


def fit_weights(optimizer, mode):
    """Trains `model()` for one epoch of `model.fit`; returns its weights."""
    trained = model()
    trained.compile(optimizer=optimizer, loss="mse", **compile_kwargs(mode))
    trained.fit(X, Y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
    return trained.get_weights()


@functools.lru_cache(maxsize=None)
def reference_weights(optimizer_name, mode):
    """The float32 reference: the plain optimizer in `model.fit`."""
    return fit_weights(OPTIMIZERS[optimizer_name](), mode)


def loop_weights(optimizer, mode, recipe, transform=None):
    """Trains `model()` one epoch in a custom loop; returns its weights.

    `recipe` is "contract" (get_scaled_loss / get_unscaled_gradients),
    "keras" (scale_loss, scaled gradients straight to apply_gradients) or
    "plain" (no loss scaling). `transform` maps the gradients just before
    they are applied.
    """
    trained = model()
    loss_fn = keras.losses.MeanSquaredError()

    def train_step(x, y):
        variables = trained.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_fn(y, trained(x, training=True))
            if recipe == "contract":
                loss = optimizer.get_scaled_loss(loss)
            elif recipe == "keras":
                loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, variables)
        if recipe == "contract":
            grads = optimizer.get_unscaled_gradients(grads)
        if transform is not None:
            grads = transform(grads)
        optimizer.apply_gradients(zip(grads, variables))

    train_step = compiled(train_step, mode)
    for start in range(0, len(X), BATCH_SIZE):
        batch = slice(start, start + BATCH_SIZE)
        train_step(tf.constant(X[batch]), tf.constant(Y[batch]))
    return trained.get_weights()


def assert_weights_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def values(variables):
    return [np.array(v) for v in variables]


def optimizer_state(optimizer):
    """The current (scale, counter, skipped_steps, iterations)."""
    counter = optimizer.dynamic_counter
    return (
        float(optimizer.loss_scale),
        None if counter is None else int(counter),
        int(optimizer.skipped_steps),
        int(optimizer.iterations),
    )


class Harness:
    """One model and optimizer, trained one step at a time.

    The loss is the mean squared error times `factor`, a variable: setting it
    to inf or NaN makes every gradient of that step non-finite.

    Args:
        optimizer: The kmp.LossScaleOptimizer to train with.
        how: "loop_<mode>" for the contract's custom loop or "fit_<mode>" for
            `model.fit`, with <mode> one of MODES.
    """

    def __init__(self, optimizer, how):
        self.model = model()
        self.optimizer = optimizer
        self.factor = tf.Variable(1.0)
        # Built up front so every slot exists before the first (maybe
        # skipped) step and can be compared.
        optimizer.build(self.model.trainable_variables)
        kind, mode = how.split("_", 1)
        self._fit = kind == "fit"
        if self._fit:
            self.model.compile(
                optimizer=optimizer, loss=self._loss, **compile_kwargs(mode)
            )
        else:
            self._train_step = compiled(self._loop_step, mode)

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
        return values(self.model.trainable_variables) + values(
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
            records[step] += [self.snapshot(), optimizer_state(self.optimizer)]

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
                assert_weights_equal(after, before)
            else:
                assert any(
                    not np.array_equal(a, b) for a, b in zip(after, before)
                ), f"step {step} changed nothing"
            skipped_before = state[2]


HARNESSES = [f"{kind}_{mode}" for kind in ("loop", "fit") for mode in MODES]
# Fit costs more than a loop; test_dynamic_scale_walk covers all of fit's
# modes, the other walks run fit in its default mode only.
FEWER_HARNESSES = [f"loop_{mode}" for mode in MODES] + ["fit_tf_function"]


def assert_unchanged_by(optimizer, call):
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

    config, attrs, before = (
        optimizer.get_config(),
        attributes(),
        values(optimizer.variables),
    )
    call()
    assert optimizer.get_config() == config
    assert attributes() == attrs
    assert_weights_equal(values(optimizer.variables), before)


# --- Saving -------------------------------------------------------------------

X_FINITE = X[:BATCH_SIZE]
X_INF = np.where(np.arange(BATCH_SIZE)[:, None] == 0, np.inf, X_FINITE)
X_INF = X_INF.astype("float32")


def fit_steps(trained, inputs_per_step):
    """One `fit` step per entry (a batch of inputs) of `inputs_per_step`."""
    for inputs in inputs_per_step:
        trained.fit(inputs, Y[:BATCH_SIZE], batch_size=BATCH_SIZE, verbose=0)


def load_model_without_skipping(path):
    """`keras.saving.load_model(path)`; fails if Keras skipped a variable."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    messages = [str(w.message) for w in caught]
    assert not any("Skipping variable loading" in m for m in messages), messages
    return loaded
