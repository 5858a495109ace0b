"""Helpers shared by the reliability tests (faults, distribution, resume).

Not a test module: tiny models, a `train_step` that injects gradient faults,
and snapshots of every variable a skipped step must leave alone.
"""

import hashlib

import keras
import numpy as np

import kmp
from tests.support import backends

FEATURES = 3
GLOBAL_BATCH = 8


def make_data(batches=4, seed=0):
    """`batches * GLOBAL_BATCH` rows of a noisy linear regression problem."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * GLOBAL_BATCH, FEATURES)).astype("float32")
    w = np.array([[0.5], [-1.0], [2.0]], "float32")
    y = (x @ w + 0.1 * rng.normal(size=(len(x), 1))).astype("float32")
    return x, y


def make_layers(hidden=4, extra=()):
    """Input -> Dense(hidden, relu) -> *extra -> Dense(1) in float32.

    The last layer is float32 whatever the global policy, as the Keras
    mixed-precision guide recommends for outputs.
    """
    return [
        keras.Input((FEATURES,)),
        keras.layers.Dense(hidden, activation="relu"),
        *extra,
        keras.layers.Dense(1, dtype="float32"),
    ]


class FaultModel(keras.Sequential):
    """A Sequential model whose `train_step` corrupts gradients on schedule.

    TensorFlow only (`kmp.testing.GradientFaults`). The step is the model's
    own `train_steps` counter (every call of `train_step`, skipped or not);
    the rest mirrors Keras's TensorFlow
    `train_step`: `optimizer.scale_loss`, then the still-scaled gradients go
    to `apply_gradients`, which unscales them.
    """

    def __init__(self, layers, faults=None, rank1_logs=False, **kwargs):
        from kmp.testing import GradientFaults

        super().__init__(layers, **kwargs)
        self.faults = faults or GradientFaults({})
        self.rank1_logs = rank1_logs
        self.train_steps = keras.Variable(
            0,
            dtype="int64",
            trainable=False,
            aggregation="only_first_replica",
            name="train_steps",
        )

    def train_step(self, data):
        tf = backends.tensorflow()
        x, y = data[0], data[1]
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_weights)
        grads = self.faults(grads, self.train_steps)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.train_steps.assign_add(1)
        if self.rank1_logs:
            return {"loss": tf.reshape(loss, [1])}
        return self.compute_metrics(x, y, y_pred)


def make_optimizer(inner=None, **kwargs):
    kwargs.setdefault("initial_scale", 2.0**4)
    kwargs.setdefault("dynamic_growth_steps", 2)
    inner = inner or keras.optimizers.SGD(0.05, momentum=0.9)
    return kmp.LossScaleOptimizer(inner, **kwargs)


def local_values(variable, strategy=None):
    """Each replica's copy of a (Keras or tf) variable, as NumPy arrays.

    Off TensorFlow there is one copy."""
    value = getattr(variable, "value", variable)
    if not backends.TENSORFLOW:
        return [keras.ops.convert_to_numpy(value)]
    strategy = strategy or backends.tensorflow().distribute.get_strategy()
    return [np.array(v) for v in strategy.experimental_local_results(value)]


def snapshot(model, optimizer, strategy=None):
    """Every model and optimizer variable, per replica, keyed by path.

    Includes the inner optimizer's slots and `iterations`, and the
    loss-scale optimizer's own scale and counters.
    """
    state = {}
    for variable in list(model.weights) + list(optimizer.variables):
        state[variable.path] = local_values(variable, strategy)
    return state


# Variables that a skipped step does change: the loss-scale state, and the
# step counters of the test helpers (`FaultModel`, `OverflowAt`).
STEP_STATE = (
    "dynamic_scale",
    "step_counter",
    "skipped_steps",
    "consecutive_skips",
    "train_steps",
    "calls",
)


def frozen(state):
    """The part of a snapshot that a skipped step must leave unchanged."""
    return {p: v for p, v in state.items() if not p.endswith(STEP_STATE)}


def split_changed(before, after):
    """The paths whose value changed (bit for bit) on any replica.

    A variable that exists only `after` (an optimizer slot created by the
    first step) counts as changed.
    """
    return sorted(
        path
        for path in after
        if path not in before
        or any(
            a.tobytes() != b.tobytes()
            for a, b in zip(before[path], after[path])
        )
    )


class Record(keras.callbacks.Callback):
    """A `snapshot` of the model and its optimizer before `fit` and after
    every batch, in `states`.

    Reading `self.model` makes Keras's JAX trainer write its state back into
    the variables first.
    """

    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_begin(self, logs=None):
        self.states.append(snapshot(self.model, self.model.optimizer))

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(snapshot(self.model, self.model.optimizer))


def scales(states):
    """The loss scale in each snapshot."""
    return [
        float(state[path][0])
        for state in states
        for path in state
        if path.endswith("dynamic_scale")
    ]


def assert_skipped_exactly(states, bad_steps):
    """Skipped steps change nothing but the loss-scale state, bit for bit;
    the others change the weights, the slots and `iterations` (of an
    optimizer with momentum)."""
    for step in range(len(states) - 1):
        changed = split_changed(frozen(states[step]), frozen(states[step + 1]))
        if step in bad_steps:
            assert changed == [], f"skipped step {step} changed {changed}"
        else:
            assert any(p.endswith("kernel") for p in changed), step
            assert any(p.endswith("/iteration") for p in changed), step
            assert any("_momentum" in p for p in changed), step


def digest(arrays):
    sha = hashlib.sha256()
    for array in arrays:
        sha.update(np.ascontiguousarray(array).tobytes())
    return sha.hexdigest()
