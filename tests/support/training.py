"""Helpers shared by the LossScaleOptimizer tests on a single device.

Not a test module: a tiny float32 model with fixed initial weights, the
float32 references it trains to, the two custom-loop recipes, and a harness
that trains one step at a time and checks the optimizer's state after each,
on whichever backend Keras runs (see `tests.support.backends`): a custom
loop's gradients come from a `tf.GradientTape`, `loss.backward()` or
`jax.grad`, and on JAX its "jit" mode is a jitted step over `stateless_call`
and `stateless_apply`.
"""

import contextlib
import functools
import threading
import warnings

import keras
import numpy as np

from tests.support import backends
from tests.support.backends import DEFAULT_FIT_MODE
from tests.support.backends import MODES

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
    """`function` to run in `mode`: as it is, in a `tf.function`, or (a pure
    function on JAX) in `jax.jit`.

    Only TensorFlow compiles stateful Python; on JAX a jitted training step
    is written over the stateless API (`StatelessStep`, `apply_step`).
    """
    assert mode in MODES, f"no mode {mode!r} on {backends.NAME}"
    if mode == "eager":
        return function
    if backends.JAX:
        import jax

        return jax.jit(function)
    tf = backends.tensorflow()
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


# --- Custom loops ---------------------------------------------------------

RECIPES = ("contract", "keras", "plain")
_step_state = threading.local()


@contextlib.contextmanager
def _in_stateless_step(optimizer, optimizer_values):
    previous = getattr(_step_state, "current", None)
    _step_state.current = (optimizer, optimizer_values)
    try:
        yield
    finally:
        _step_state.current = previous


def unscale(optimizer, grads):
    """`optimizer.get_unscaled_gradients(grads)`, or inside a JAX jitted
    `StatelessStep` its stateless form with the step's optimizer values."""
    current = getattr(_step_state, "current", None)
    if current is not None and current[0] is optimizer:
        return optimizer.stateless_unscale_gradients(current[1], grads)
    return optimizer.get_unscaled_gradients(grads)


def eager_step(model, optimizer, loss_fn, recipe, transform=None):
    """One training step `step(x, y)` of `model` on any backend.

    `recipe` is "contract" (get_scaled_loss / get_unscaled_gradients),
    "keras" (scale_loss, scaled gradients straight to apply_gradients) or
    "plain" (no loss scaling). `transform` maps the gradients just before
    they are applied. On TensorFlow it may be wrapped in a `tf.function`.
    """

    def step(x, y):
        variables = model.trainable_variables

        def loss():
            value = loss_fn(y, model(x, training=True))
            if recipe == "contract":
                value = optimizer.get_scaled_loss(value)
            elif recipe == "keras":
                value = optimizer.scale_loss(value)
            return value

        grads = backends.gradients(loss, variables)
        if recipe == "contract":
            grads = optimizer.get_unscaled_gradients(grads)
        if transform is not None:
            grads = transform(grads)
        optimizer.apply_gradients(zip(grads, variables))

    return step


class StatelessStep:
    """One training step of `model` as a jitted pure function (JAX).

    `jax.grad` over `model.stateless_call`, the loss scaled with
    `stateless_scale_loss`, (for the "contract" recipe) unscaled with
    `stateless_unscale_gradients`, then `stateless_apply`: the loop the
    contract promises on JAX. Calling it runs the jitted step on the
    variables' values and assigns the results back.
    """

    def __init__(self, model, optimizer, loss_fn, recipe, transform=None):
        import jax

        assert recipe in RECIPES, recipe
        self.model = model
        self.optimizer = optimizer
        self._loss_fn = loss_fn
        self._recipe = recipe
        self._transform = transform
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.traces = 0
        self._jitted = jax.jit(self._pure)

    def _pure(self, trainable, non_trainable, optimizer_values, x, y):
        import jax
        from keras.src.backend.common.stateless_scope import StatelessScope

        self.traces += 1
        model, optimizer, recipe = self.model, self.optimizer, self._recipe

        def loss_of(trainable):
            y_pred, new_non_trainable = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            mapping = list(zip(model.non_trainable_variables, non_trainable))
            with StatelessScope(state_mapping=mapping):
                loss = self._loss_fn(y, y_pred)
            if recipe != "plain":
                loss = optimizer.stateless_scale_loss(optimizer_values, loss)
            return loss, new_non_trainable

        grads, non_trainable = jax.grad(loss_of, has_aux=True)(trainable)
        scaled = None
        if recipe == "contract":
            grads = optimizer.stateless_unscale_gradients(
                optimizer_values, grads
            )
            scaled = False
        if self._transform is not None:
            with _in_stateless_step(optimizer, optimizer_values):
                grads = self._transform(grads)
        if recipe == "plain":
            trainable, optimizer_values = optimizer.stateless_apply(
                optimizer_values, grads, trainable
            )
        else:
            trainable, optimizer_values = optimizer.stateless_apply(
                optimizer_values, grads, trainable, scaled=scaled
            )
        return trainable, non_trainable, optimizer_values

    def __call__(self, x, y):
        model, optimizer = self.model, self.optimizer
        trainable, non_trainable, optimizer_values = self._jitted(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
            x,
            y,
        )
        for variables, new_values in (
            (model.trainable_variables, trainable),
            (model.non_trainable_variables, non_trainable),
            (optimizer.variables, optimizer_values),
        ):
            for variable, value in zip(variables, new_values):
                variable.assign(value)


def apply_step(optimizer, grads, variables, mode):
    """Applies `grads` to `variables` once, in `mode` (one of `MODES`).

    On JAX "jit" is `optimizer.stateless_apply` inside `jax.jit` (the
    optimizer built with `variables`), its results assigned back.
    """
    if not (backends.JAX and mode == "jit"):

        def step():
            optimizer.apply_gradients(zip(grads, variables))

        compiled(step, mode)()
        return
    import jax

    if not optimizer.built:
        optimizer.build(variables)
    new_values, optimizer_values = jax.jit(optimizer.stateless_apply)(
        [v.value for v in optimizer.variables],
        list(grads),
        [v.value for v in variables],
    )
    for variable, value in zip(variables, new_values):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_values):
        variable.assign(value)


def loop_step(model, optimizer, loss_fn, recipe, mode, transform=None):
    """A training step `step(x, y)` in `mode` (one of `MODES`)."""
    if backends.JAX and mode == "jit":
        return StatelessStep(model, optimizer, loss_fn, recipe, transform)
    return compiled(
        eager_step(model, optimizer, loss_fn, recipe, transform), mode
    )


def loop_weights(optimizer, mode, recipe, transform=None):
    """Trains `model()` one epoch in a custom loop; returns its weights.

    See `eager_step` for `recipe` and `transform`.
    """
    trained = model()
    loss_fn = keras.losses.MeanSquaredError()
    train_step = loop_step(trained, optimizer, loss_fn, recipe, mode, transform)
    for start in range(0, len(X), BATCH_SIZE):
        batch = slice(start, start + BATCH_SIZE)
        train_step(backends.tensor(X[batch]), backends.tensor(Y[batch]))
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

    The loss is the mean squared error times `factor`, a non-trainable
    variable of the model (so a jitted JAX step reads it as state): setting
    it to inf or NaN makes every gradient of that step non-finite.

    Args:
        optimizer: The kmp.LossScaleOptimizer to train with.
        how: "loop_<mode>" for the contract's custom loop or "fit_<mode>" for
            `model.fit`, with <mode> one of MODES.
    """

    def __init__(self, optimizer, how):
        self.model = model()
        self.optimizer = optimizer
        self.factor = keras.Variable(1.0, trainable=False, name="factor")
        self.model.factor = self.factor
        # Built up front so every slot exists before the first (maybe
        # skipped) step and can be compared.
        optimizer.build(self.model.trainable_variables)
        kind, mode = how.split("_", 1)
        assert mode in MODES, f"{how}: no mode {mode!r} on {backends.NAME}"
        self._fit = kind == "fit"
        if self._fit:
            self.model.compile(
                optimizer=optimizer, loss=self._loss, **compile_kwargs(mode)
            )
        else:
            self._train_step = loop_step(
                self.model,
                optimizer,
                lambda y, y_pred: keras.ops.mean(self._loss(y, y_pred)),
                "contract",
                mode,
            )

    def _loss(self, y_true, y_pred):
        return keras.losses.mean_squared_error(y_true, y_pred) * self.factor

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
            repeats = (len(factors), 1)
            self.model.fit(
                np.tile(x, repeats),
                np.tile(y, repeats),
                batch_size=BATCH_SIZE,
                shuffle=False,
                verbose=0,
                callbacks=[_EveryBatch(begin, end)],
            )
        else:
            for step in range(len(factors)):
                begin(step)
                self._train_step(backends.tensor(x), backends.tensor(y))
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


class _EveryBatch(keras.callbacks.Callback):
    """Calls `begin(step)` before and `end(step)` after every batch of fit.

    Reading `self.model` makes Keras's JAX trainer put its state back into
    the variables (and take a value assigned here into the next step).
    """

    def __init__(self, begin, end):
        super().__init__()
        self._begin, self._end = begin, end

    def on_train_batch_begin(self, batch, logs=None):
        assert self.model is not None
        self._begin(batch)

    def on_train_batch_end(self, batch, logs=None):
        assert self.model is not None
        self._end(batch)


HARNESSES = [f"{kind}_{mode}" for kind in ("loop", "fit") for mode in MODES]
# Fit costs more than a loop; test_dynamic_scale_walk covers all of fit's
# modes, the other walks run fit in its default mode only.
FEWER_HARNESSES = [f"loop_{mode}" for mode in MODES]
FEWER_HARNESSES.append(f"fit_{DEFAULT_FIT_MODE}")


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


def nan_batches(bad_batches, batches=6):
    """`batches` batches of X and Y, a NaN input in each of `bad_batches`."""
    x = np.resize(X, (batches * BATCH_SIZE, X.shape[1]))
    y = np.resize(Y, (batches * BATCH_SIZE, Y.shape[1]))
    for batch in bad_batches:
        x[batch * BATCH_SIZE + 3, 1] = NAN
    return x, y


def fit_steps(trained, inputs_per_step):
    """One `fit` step per entry (a batch of inputs) of `inputs_per_step`,
    its rows in order: `fit` would shuffle them (`shuffle=True`) by the
    global seed's next draw, so two models given the same batches would
    sum their losses in different orders and differ by an ulp."""
    for inputs in inputs_per_step:
        trained.fit(
            inputs,
            Y[:BATCH_SIZE],
            batch_size=BATCH_SIZE,
            shuffle=False,
            verbose=0,
        )


def load_model_without_skipping(path):
    """`keras.saving.load_model(path)`; fails if Keras skipped a variable."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    messages = [str(w.message) for w in caught]
    assert not any("Skipping variable loading" in m for m in messages), messages
    return loaded
