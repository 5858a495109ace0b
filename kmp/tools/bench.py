"""`kmp bench`: how fast and how well each dtype policy trains, measured fairly.

The same small classifier (Dense -> Dense -> Dense logits -> a float32 softmax)
trains on scikit-learn's bundled digits under every requested policy, with
`model.fit`'s train step and with a custom `tf.GradientTape` loop. Policies
that compute in float16 use `kmp.LossScaleOptimizer` (`get_scaled_loss`,
`get_unscaled_gradients`, `apply_gradients` in the custom loop); the others
use the plain optimizer. With `native=True` the loss-scaled configurations
run a second time with Keras 3's own `keras.optimizers.LossScaleOptimizer`,
so the cost of kmp shows as a ratio. The other policies run the same Keras
code with or without kmp, so they have no native twin.

Steps are timed by `kmp.tools.timing` (the toolkit `benchmarks/` uses too):
every configuration is warmed up first (tracing and the first steps are not
timed), then the timed steps run in interleaved rounds whose order rotates,
each step timed on its own up to reading its loss; the tables show medians
with the interquartile range. The `fit` rows time the train function `fit`
runs for every batch (`model.make_train_function()`), fed by a distributed
`tf.data` iterator as in `fit`; only `fit`'s callbacks and progress bar are
left out.

Every configuration trains on the same batches in the same order, the same
number of steps, from the same weights. Neither path uses XLA
(`jit_compile=False`), so `fit` and the custom loop compile alike on every
machine. TensorFlow backend only: the custom loop is a `tf.function` with a
`tf.GradientTape`, the `fit` path feeds a `tf.data` iterator, and float16
configurations turn TensorFlow's op fusion off (`FLOAT16_FUSION_NOTE`).
"""

import contextlib
from typing import Dict
from typing import List
from typing import Sequence

import keras
import numpy as np

import kmp
from kmp.core.backend import tensorflow as _tensorflow
from kmp.core.policy import POLICY_NAMES
from kmp.core.policy import policy_scope
from kmp.tools import timing
from kmp.tools.bench_report import LOOP_WORDS
from kmp.tools.bench_report import LOOPS

tf = _tensorflow()

DEFAULT_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# Sized so that the default run takes one to two minutes on a 2-core CPU
# and the matrix products are large enough for 16-bit compute to matter.
DEFAULT_STEPS = 400
DEFAULT_BATCH_SIZE = 256
DEFAULT_UNITS = 2048
DEFAULT_ROUNDS = 5
DEFAULT_WARMUP_STEPS = 10

_SEED = 0
_CLASSES = 10


def _needs_loss_scaling(policy: str) -> bool:
    """Loss scaling is for float16 compute, where small gradients underflow."""
    return kmp.Policy(policy).compute_dtype == "float16"


@contextlib.contextmanager
def _op_fusion(policy):
    """Turns TensorFlow's op fusion ('remapping') off for float16 compute.

    On CPUs its fused float16 MatMul + BiasAdd kernel is far slower than the
    plain ops (benchmarks/README.md), which would make float16 look far
    worse than it is; float32 and bfloat16 keep the fusion, as users get it.
    The option is read at every call, so it can change between
    configurations.
    """
    options = tf.config.optimizer.get_experimental_options()
    compute = kmp.Policy(policy).compute_dtype
    on_cpu = not tf.config.list_physical_devices("GPU")
    if on_cpu and compute == "float16":
        tf.config.optimizer.set_experimental_options({"remapping": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(
            {"remapping": options.get("remapping", True)}
        )


# --- Validation ---------------------------------------------------------------


def _check_names(values, allowed, argument):
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(
            f"'{argument}' must be a list of names from "
            f"{', '.join(allowed)}. Received: {argument}={values!r}"
        )
    values = tuple(values)
    for value in values:
        if value not in allowed:
            raise ValueError(
                f"'{argument}' must name only {', '.join(allowed)}. "
                f"Received: {argument}={values!r}"
            )
    if not values or len(set(values)) != len(values):
        raise ValueError(
            f"'{argument}' must name at least one of {', '.join(allowed)}, "
            f"each once. Received: {argument}={values!r}"
        )
    return values


def _check_count(value, argument, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"'{argument}' must be an integer >= {minimum}. Received: "
            f"{argument}={value!r} of type {type(value).__name__}"
        )
    if value < minimum:
        raise ValueError(
            f"'{argument}' must be an integer >= {minimum}. Received: "
            f"{argument}={value!r}"
        )
    return value


# --- Data and model -----------------------------------------------------------


def _load_digits():
    """The bundled digits, split 75/25 with a fixed seed, scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # Pixel values are 0..16.
    y = digits.target.astype("int32")
    return train_test_split(
        x, y, test_size=0.25, random_state=_SEED, stratify=y
    )


class _Batches:
    """`steps` batches, one shuffled pass after another, made once.

    `x`, `y`: all of them, stacked (for `tf.data`); `x_list`, `y_list`: one
    tensor per batch, so that a step takes its batch without an op.
    """

    def __init__(self, x, y, steps, batch_size):
        rng = np.random.default_rng(_SEED)
        needed = steps * batch_size
        passes = -(-needed // len(x))
        order = np.concatenate([rng.permutation(len(x)) for _ in range(passes)])
        order = order[:needed].reshape(steps, batch_size)
        self.x, self.y = tf.constant(x[order]), tf.constant(y[order])
        self.x_list, self.y_list = tf.unstack(self.x), tf.unstack(self.y)


def _build_model(policy, units, features):
    # Seeded initialisers: every configuration starts from the same weights,
    # without touching the global random state.
    def dense(width, seed, activation=None):
        return keras.layers.Dense(
            width,
            activation=activation,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        )

    with policy_scope(policy):
        inputs = keras.Input(shape=(features,))
        hidden = dense(units, 1, "relu")(inputs)
        hidden = dense(units, 2, "relu")(hidden)
        logits = dense(_CLASSES, 3)(hidden)
        # The softmax and the model's output stay float32 under every policy.
        outputs = keras.layers.Activation("softmax", dtype="float32")(logits)
        return keras.Model(inputs, outputs, name=f"digits_{policy}")


def _cross_entropy(probabilities, labels):
    picked = probabilities[np.arange(len(labels)), labels].astype("float64")
    return float(-np.mean(np.log(np.clip(picked, 1e-7, 1.0))))


# --- Configurations -----------------------------------------------------------


class _Configuration:
    """One model, optimizer and loop: a `timing` subject, and its record."""

    def __init__(self, policy, loop, implementation, units, batches):
        self.policy = policy
        self.loop = loop
        self.implementation = implementation
        self.loss_scaled = _needs_loss_scaling(policy)
        self.model = _build_model(policy, units, batches.x.shape[-1])
        inner = keras.optimizers.Adam(learning_rate=1e-3)
        if not self.loss_scaled:
            self.optimizer = inner
        elif implementation == "kmp":
            self.optimizer = kmp.LossScaleOptimizer(inner)
        else:
            self.optimizer = keras.optimizers.LossScaleOptimizer(inner)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.label = f"{policy} / {LOOP_WORDS[loop]} / {implementation}"
        self.step_seconds = []  # Timed steps only.
        self.losses = []  # Every step's batch loss, warm-up included.
        self.loss_scales = []  # The scale after every step, when loss-scaled.
        self.skipped_at = []  # The (1-based) steps that were skipped.
        self._skipped_so_far = 0
        self.steps_run = 0
        if loop == "fit":
            self._run = self._fit_step(batches)
        else:
            self._run = self._custom_step(batches)

    def _custom_step(self, batches):
        model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn
        variables = model.trainable_variables
        # Built before tracing, so the step reads the optimizer's variables
        # (the loss scale included) rather than their initial values.
        optimizer.build(variables)
        protocol = "plain"
        if self.loss_scaled:
            protocol = self.implementation

        @tf.function(jit_compile=False)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                if protocol == "kmp":
                    target = optimizer.get_scaled_loss(loss)
                elif protocol == "native":
                    # Keras 3's protocol: apply_gradients unscales by itself.
                    target = optimizer.scale_loss(loss)
                else:
                    target = loss
            grads = tape.gradient(target, variables)
            if protocol == "kmp":
                grads = optimizer.get_unscaled_gradients(grads)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        def run():
            index = self.steps_run
            return step(batches.x_list[index], batches.y_list[index])

        return run

    def _fit_step(self, batches):
        # An explicit loss-scale optimizer is used as it is: kmp's own for
        # the kmp rows, Keras's for the native ones.
        self.model.compile(
            optimizer=self.optimizer, loss=self.loss_fn, jit_compile=False
        )
        dataset = tf.data.Dataset.from_tensor_slices((batches.x, batches.y))
        strategy = self.model.distribute_strategy
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        self.model.make_train_function()
        train_function = self.model.train_function

        def run():
            return train_function(iterator)["loss"]

        return run

    def step(self):
        """Runs the next training step; returns its loss (a tensor)."""
        return self._run()

    def record(self, loss, seconds, timed):
        """Keeps what one step did (called after it, off the clock)."""
        self.losses.append(float(loss))
        if timed:
            self.step_seconds.append(seconds)
        self.steps_run += 1
        if self.loss_scaled:
            self.loss_scales.append(self.current_loss_scale())
            skipped = self.skipped_steps()
            if skipped > self._skipped_so_far:
                self.skipped_at.append(self.steps_run)
                self._skipped_so_far = skipped
        if self.loop == "fit":
            # fit logs the loss averaged since the last reset: reset it so
            # that the next step logs its own.
            self.model.reset_metrics()

    def current_loss_scale(self):
        if self.implementation == "kmp":
            return float(self.optimizer.loss_scale)
        return float(np.asarray(self.optimizer.dynamic_scale))

    def skipped_steps(self):
        if self.implementation == "kmp":
            return int(self.optimizer.skipped_steps)
        # Keras's optimizer counts no skips, but a skipped step does not
        # advance the inner optimizer's iterations.
        applied = int(np.asarray(self.optimizer.inner_optimizer.iterations))
        return self.steps_run - applied


# --- The benchmark ------------------------------------------------------------


def _result(configuration, data, batch_size, units, warmup_steps):
    x_train, x_test, y_train, y_test = data
    model = configuration.model
    train_probabilities = np.asarray(model(x_train, training=False))
    test_probabilities = np.asarray(model(x_test, training=False))
    accuracy = float(np.mean(test_probabilities.argmax(axis=1) == y_test))
    measured = timing.Timing(
        configuration.label, times=configuration.step_seconds
    )
    low, q1, median, q3, high = (t * 1000.0 for t in measured.quantiles())
    scaled = configuration.loss_scaled
    return {
        "policy": configuration.policy,
        "loop": configuration.loop,
        "implementation": configuration.implementation,
        "loss_scaling": scaled,
        "device": "gpu" if tf.config.list_physical_devices("GPU") else "cpu",
        "batch_size": batch_size,
        "units": units,
        "warmup_steps": warmup_steps,
        "steps": len(measured.times),
        "step_times_ms": [seconds * 1000.0 for seconds in measured.times],
        "median_ms": median,
        "q1_ms": q1,
        "q3_ms": q3,
        "min_ms": low,
        "max_ms": high,
        "samples_per_second": batch_size / (median / 1000.0),
        "speedup_vs_float32": None,
        "kmp_over_native": None,
        "final_loss": _cross_entropy(train_probabilities, y_train),
        "test_accuracy": accuracy,
        "losses": list(configuration.losses),
        "loss_scales": list(configuration.loss_scales) if scaled else None,
        "final_loss_scale": configuration.current_loss_scale()
        if scaled
        else None,
        "skipped_steps": configuration.skipped_steps() if scaled else None,
        "skipped_at": list(configuration.skipped_at) if scaled else None,
    }


def add_comparisons(results: List[Dict]) -> None:
    """Fills in the speed-up vs float32 and, on native rows, kmp / native."""
    float32_ms = {
        r["loop"]: r["median_ms"]
        for r in results
        if r["policy"] == "float32" and r["implementation"] == "kmp"
    }
    kmp_ms = {
        (r["policy"], r["loop"]): r["median_ms"]
        for r in results
        if r["implementation"] == "kmp"
    }
    for r in results:
        if r["loop"] in float32_ms:
            r["speedup_vs_float32"] = float32_ms[r["loop"]] / r["median_ms"]
        if r["implementation"] == "native":
            mine = kmp_ms.get((r["policy"], r["loop"]))
            if mine is not None:
                r["kmp_over_native"] = mine / r["median_ms"]


def run_benchmark(
    policies: Sequence[str] = DEFAULT_POLICIES,
    loops: Sequence[str] = LOOPS,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    units: int = DEFAULT_UNITS,
    rounds: int = DEFAULT_ROUNDS,
    native: bool = True,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    verbose: bool = True,
) -> List[Dict]:
    """Trains the digits classifier under each policy and loop, and times it.

    Builds every configuration (policy x loop, plus Keras's own loss scaling
    for the float16 policies when `native`), warms each up with its first
    call and `warmup_steps` more untimed steps, then runs `steps` timed steps
    of each, split into `rounds` interleaved rounds, each round starting
    each configuration with one untimed step (`kmp.tools.timing.measure`).
    Changes no global state: policies are set with `kmp.policy_scope` while
    each model is built.

    Args:
        policies: Policy names, from `kmp.core.policy.POLICY_NAMES`.
        loops: `"fit"` and/or `"custom"`.
        steps: Timed training steps per configuration.
        batch_size: Examples per step.
        units: Width of the two hidden layers.
        rounds: How many interleaved rounds the timed steps are split into; at
            most `steps`.
        native: Also run the loss-scaled policies with
            `keras.optimizers.LossScaleOptimizer`.
        warmup_steps: Untimed steps per configuration after its first call
            and before the rounds.
        verbose: Print what runs when.

    Returns:
        One dict per configuration, kmp rows first in the order requested,
        then native rows. Keys: `policy`, `loop`, `implementation` (`"kmp"`
        or `"native"`), `loss_scaling`, `step_times_ms` (every timed step),
        `median_ms`, `q1_ms`, `q3_ms`, `min_ms`, `max_ms`,
        `samples_per_second`, `speedup_vs_float32` (None without a float32
        run), `kmp_over_native` (native rows), `final_loss` (cross-entropy on
        the whole training set after training), `test_accuracy` (a fraction),
        `losses` (every step's batch loss, untimed steps included),
        `loss_scales`, `final_loss_scale`, `skipped_steps` (None without loss
        scaling), and the settings `batch_size`, `units`, `warmup_steps`,
        `steps`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an unknown policy or loop, a count below 1, or more
            rounds than steps.

    Example:

    >>> results = run_benchmark(
    ...     ["float32"], ["custom"], steps=2, batch_size=8, units=4,
    ...     rounds=1, warmup_steps=1, verbose=False)
    >>> [(r["policy"], r["loop"], r["steps"], len(r["losses"]))
    ...  for r in results]
    [('float32', 'custom', 2, 5)]
    """
    policies = _check_names(policies, POLICY_NAMES, "policies")
    loops = _check_names(loops, LOOPS, "loops")
    for value, argument in (
        (steps, "steps"),
        (batch_size, "batch_size"),
        (units, "units"),
        (rounds, "rounds"),
        (warmup_steps, "warmup_steps"),
    ):
        _check_count(value, argument)
    if rounds > steps:
        raise ValueError(
            "'rounds' must be at most 'steps': every round runs at least one "
            f"step. Received: rounds={rounds}, steps={steps}"
        )

    data = _load_digits()
    x_train, _, y_train, _ = data
    # The first call, the warm-up, one untimed step per round, the timed.
    total = 1 + warmup_steps + rounds + steps
    batches = _Batches(x_train, y_train, total, batch_size)

    plan = [(p, loop, "kmp") for p in policies for loop in loops]
    if native:
        plan += [
            (p, loop, "native")
            for p in policies
            if _needs_loss_scaling(p)
            for loop in loops
        ]
    log = print if verbose else None
    if verbose:
        print(
            f"Building and warming up {len(plan)} configurations (the first "
            f"call and {warmup_steps} more untimed steps each)...",
            flush=True,
        )
    configurations = []
    for policy, loop, implementation in plan:
        configurations.append(
            _Configuration(policy, loop, implementation, units, batches)
        )
    timing.measure(
        configurations,
        rounds=rounds,
        steps=timing.chunks(steps, rounds),
        warmup_min=warmup_steps,
        warmup_max=warmup_steps,
        context=lambda configuration: _op_fusion(configuration.policy),
        observe=lambda c, loss, seconds, timed: c.record(loss, seconds, timed),
        log=log,
        progress=log,
    )
    results = [
        _result(c, data, batch_size, units, warmup_steps)
        for c in configurations
    ]
    add_comparisons(results)
    return results


__all__ = [
    "DEFAULT_POLICIES",
    "add_comparisons",
    "run_benchmark",
]
