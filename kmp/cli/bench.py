"""`kmp bench`: how fast and how well each dtype policy trains, measured fairly.

The same small classifier (Dense -> Dense -> Dense logits -> a float32 softmax)
trains on scikit-learn's bundled digits under every requested policy, with
`model.fit` and with a custom `tf.GradientTape` loop. Policies that compute in
float16 use `kmp.LossScaleOptimizer` (`get_scaled_loss`,
`get_unscaled_gradients`, `apply_gradients` in the custom loop); the others use
the plain optimizer. With `native=True` the loss-scaled configurations run a
second time with Keras 3's own `keras.optimizers.LossScaleOptimizer`, so the
cost of kmp shows as a ratio. The other policies run the same Keras code with or
without kmp, so they have no native twin.

How it measures, so that a busy machine does not decide the result:

* every configuration is built and warmed up first (tracing and the first,
  slow steps are not timed);
* the timed steps run in rounds: each round trains every configuration for a
  chunk of steps, in an order that rotates from round to round, and training
  continues from round to round with the same model and optimizer;
* each step is timed on its own, up to reading its loss value (which waits for
  the step to finish); `fit` steps are timed by a callback
  (`on_train_batch_begin` / `on_train_batch_end`), not the whole `fit` call;
* the table reports medians with the interquartile range.

Every configuration sees the same batches in the same order and starts from the
same weights. Neither path uses XLA (`jit_compile=False`), so `fit` and the
custom loop compile alike on every machine.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from typing import Dict
from typing import List
from typing import Sequence

import keras
import numpy as np

import kmp
from kmp.core.backend import tensorflow as _tensorflow
from kmp.core.policy import POLICY_NAMES
from kmp.core.policy import policy_scope

tf = _tensorflow()

LOOPS = ("fit", "custom")
DEFAULT_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# Sized so that the default run takes 1-2 minutes on a 2-core CPU and
# the matrix multiplications are large enough for 16-bit compute to matter.
DEFAULT_STEPS = 400
DEFAULT_BATCH_SIZE = 256
DEFAULT_UNITS = 2048
DEFAULT_ROUNDS = 5
DEFAULT_WARMUP_STEPS = 10

COLUMNS = (
    "policy",
    "loop",
    "ms/step (median)",
    "speed-up vs float32",
    "samples/s",
    "final loss",
    "test accuracy",
    "final loss scale",
    "skipped steps",
)
RATIO_COLUMN = "kmp / native"

_SEED = 0
_CLASSES = 10
# Accuracies closer than this (in percentage points) count as the same.
_SAME_ACCURACY_POINTS = 1.0
# Step-time ratios closer to 1 than this count as "about as fast".
_SAME_SPEED = 0.05
_LOOP_WORDS = {"fit": "model.fit", "custom": "custom loop"}


def _needs_loss_scaling(policy: str) -> bool:
    """Loss scaling is for float16 compute, where small gradients underflow."""
    return kmp.Policy(policy).compute_dtype == "float16"


# --- Validation --------------------------------------------------------------


@contextlib.contextmanager
def _op_fusion(policy):
    """Turns TensorFlow's op fusion ('remapping') off for float16 compute.

    On CPUs its fused float16 MatMul + BiasAdd kernel is about a thousand
    times slower than the plain ops, which would make float16 look far worse
    than it is; float32 and bfloat16 keep the fusion, as users get it. The
    option is read at every call, so it can change between configurations.
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


FLOAT16_FUSION_NOTE = (
    "float16 configurations ran with TensorFlow's op fusion ('remapping') "
    "off: on CPUs its fused float16 MatMul + BiasAdd kernel is about 1000x "
    "slower than the plain ops. To train like this yourself: "
    "tf.config.optimizer.set_experimental_options({'remapping': False})."
)


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


# --- Data and model ----------------------------------------------------------


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


def _batch_order(num_examples, steps, batch_size):
    """Example indices for `steps` batches: one shuffled pass after another."""
    rng = np.random.default_rng(_SEED)
    needed = steps * batch_size
    passes = -(-needed // num_examples)
    order = np.concatenate(
        [rng.permutation(num_examples) for _ in range(passes)]
    )
    return order[:needed].reshape(steps, batch_size)


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


# --- Configurations ----------------------------------------------------------


class _Configuration:
    """One model + optimizer + training loop, and what was measured on it."""

    def __init__(self, policy, loop, implementation, units, features):
        self.policy = policy
        self.loop = loop
        self.implementation = implementation
        self.loss_scaled = _needs_loss_scaling(policy)
        self.model = _build_model(policy, units, features)
        inner = keras.optimizers.Adam(learning_rate=1e-3)
        if not self.loss_scaled:
            self.optimizer = inner
        elif implementation == "kmp":
            self.optimizer = kmp.LossScaleOptimizer(inner)
        else:
            self.optimizer = keras.optimizers.LossScaleOptimizer(inner)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.step_seconds = []  # Timed steps only.
        self.losses = []  # Every step's training-batch loss, warm-up included.
        self.loss_scales = []  # The scale after every step, when loss-scaled.
        self.steps_run = 0

    @property
    def label(self):
        return (
            f"{self.policy} / {_LOOP_WORDS[self.loop]} / {self.implementation}"
        )

    def train(self, x, y, batch_size, timed, verbose):
        """Trains one step per `batch_size` rows of `x`, recording each step."""
        raise NotImplementedError

    def record(self, loss, seconds, timed):
        self.losses.append(loss)
        if timed:
            self.step_seconds.append(seconds)
        if self.loss_scaled:
            self.loss_scales.append(self.current_loss_scale())
        self.steps_run += 1

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


class _CustomLoop(_Configuration):
    def __init__(self, *args):
        super().__init__(*args)
        self.optimizer.build(self.model.trainable_variables)
        self._step = tf.function(self._make_step())

    def _make_step(self):
        model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn
        variables = model.trainable_variables

        def plain_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        def kmp_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled_loss = optimizer.get_scaled_loss(loss)
            scaled_grads = tape.gradient(scaled_loss, variables)
            grads = optimizer.get_unscaled_gradients(scaled_grads)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        def native_step(x, y):
            # Keras 3's protocol: apply_gradients unscales by itself.
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled_loss = optimizer.scale_loss(loss)
            scaled_grads = tape.gradient(scaled_loss, variables)
            optimizer.apply_gradients(zip(scaled_grads, variables))
            return loss

        if not self.loss_scaled:
            return plain_step
        return kmp_step if self.implementation == "kmp" else native_step

    def train(self, x, y, batch_size, timed, verbose):
        steps = len(x) // batch_size
        # Batches become tensors before the clock starts.
        xs = tf.unstack(tf.reshape(x, (steps, batch_size, -1)))
        ys = tf.unstack(tf.reshape(y, (steps, batch_size)))
        progress = keras.utils.Progbar(steps) if verbose else None
        for index in range(steps):
            start = time.perf_counter()
            loss = float(self._step(xs[index], ys[index]))
            seconds = time.perf_counter() - start
            self.record(loss, seconds, timed)
            if progress is not None:
                progress.update(index + 1, [("loss", loss)])


class _StepTimer(keras.callbacks.Callback):
    """Times each `fit` step and recovers its own loss from the running mean."""

    def __init__(self, configuration):
        super().__init__()
        self._configuration = configuration
        self.timed = False
        self._start = 0.0
        self._previous_mean = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Keras has already read the logs into Python floats, which waited for
        # the step to finish.
        seconds = time.perf_counter() - self._start
        mean = float(logs["loss"])
        if batch == 0:
            self._previous_mean = 0.0
        # fit logs the mean loss of the epoch so far; the batches are equal.
        loss = (batch + 1) * mean - batch * self._previous_mean
        self._previous_mean = mean
        self._configuration.record(loss, seconds, self.timed)


class _FitLoop(_Configuration):
    def __init__(self, *args):
        super().__init__(*args)
        # An explicit loss-scale optimizer is used as it is: kmp's own for the
        # kmp rows, Keras's for the native ones.
        self.model.compile(
            optimizer=self.optimizer, loss=self.loss_fn, jit_compile=False
        )
        self._timer = _StepTimer(self)

    def train(self, x, y, batch_size, timed, verbose):
        self._timer.timed = timed
        self.model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=1,
            shuffle=False,
            verbose=1 if verbose else 0,
            callbacks=[self._timer],
        )


# --- The benchmark -----------------------------------------------------------


def _chunks(steps, rounds):
    """Splits `steps` into `rounds` chunks whose sizes differ by at most one."""
    base, extra = divmod(steps, rounds)
    return [base + (1 if index < extra else 0) for index in range(rounds)]


def _quartiles(values):
    if len(values) == 1:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def _result(configuration, data, batch_size, units, warmup_steps):
    x_train, x_test, y_train, y_test = data
    model = configuration.model
    train_probabilities = np.asarray(model(x_train, training=False))
    test_probabilities = np.asarray(model(x_test, training=False))
    accuracy = float(np.mean(test_probabilities.argmax(axis=1) == y_test))
    times_ms = [seconds * 1000.0 for seconds in configuration.step_seconds]
    median = statistics.median(times_ms)
    q1, q3 = _quartiles(times_ms)
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
        "steps": len(times_ms),
        "step_times_ms": times_ms,
        "median_ms": median,
        "q1_ms": q1,
        "q3_ms": q3,
        "min_ms": min(times_ms),
        "max_ms": max(times_ms),
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
    }


def _add_comparisons(results):
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
    for the float16 policies when `native`), warms each up with
    `warmup_steps` untimed steps, then runs `steps` timed steps of each, split
    into `rounds` interleaved rounds. Changes no global state: policies are
    set with `kmp.policy_scope` while each model is built.

    Args:
        policies: Policy names, from `kmp.policy.POLICY_NAMES`.
        loops: `"fit"` and/or `"custom"`.
        steps: Timed training steps per configuration.
        batch_size: Examples per step.
        units: Width of the two hidden layers.
        rounds: How many interleaved rounds the timed steps are split into; at
            most `steps`.
        native: Also run the loss-scaled policies with
            `keras.optimizers.LossScaleOptimizer`.
        warmup_steps: Untimed steps per configuration before the rounds,
            covering tracing and the slow first steps.
        verbose: Print progress bars and what runs when.

    Returns:
        One dict per configuration, kmp rows first in the order requested,
        then native rows. Keys: `policy`, `loop`, `implementation` (`"kmp"`
        or `"native"`), `loss_scaling`, `step_times_ms` (every timed step),
        `median_ms`, `q1_ms`, `q3_ms`, `min_ms`, `max_ms`,
        `samples_per_second`, `speedup_vs_float32` (None without a float32
        run), `kmp_over_native` (native rows), `final_loss` (cross-entropy on
        the whole training set after training), `test_accuracy` (a fraction),
        `losses` (every step's batch loss, warm-up included), `loss_scales`,
        `final_loss_scale`, `skipped_steps` (None without loss scaling), and
        the settings `batch_size`, `units`, `warmup_steps`, `steps`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an unknown policy or loop, a count below 1, or more
            rounds than steps.

    Example:

    >>> results = run_benchmark(
    ...     ["float32"], ["custom"], steps=2, batch_size=8, units=4,
    ...     rounds=1, warmup_steps=1, verbose=False)
    >>> [(r["policy"], r["loop"], r["steps"]) for r in results]
    [('float32', 'custom', 2)]
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
    batches = _batch_order(len(x_train), warmup_steps + steps, batch_size)

    plan = [(p, loop, "kmp") for p in policies for loop in loops]
    if native:
        plan += [
            (p, loop, "native")
            for p in policies
            if _needs_loss_scaling(p)
            for loop in loops
        ]
    if verbose:
        print(
            f"Building and warming up {len(plan)} configurations "
            f"({warmup_steps} untimed steps each, tracing included)..."
        )
    configurations = []
    for policy, loop, implementation in plan:
        started = time.perf_counter()
        kind = _FitLoop if loop == "fit" else _CustomLoop
        configuration = kind(
            policy, loop, implementation, units, x_train.shape[1]
        )
        indices = batches[:warmup_steps].reshape(-1)
        with _op_fusion(policy):
            configuration.train(
                x_train[indices], y_train[indices], batch_size, False, False
            )
        configurations.append(configuration)
        if verbose:
            print(
                f"  {configuration.label}: ready in "
                f"{time.perf_counter() - started:.1f} s"
            )

    first = warmup_steps
    for round_index, chunk in enumerate(_chunks(steps, rounds)):
        indices = batches[first : first + chunk].reshape(-1)
        first += chunk
        x, y = x_train[indices], y_train[indices]
        # Rotating the order keeps any configuration from always running
        # right after the same neighbour.
        shift = round_index % len(configurations)
        for configuration in configurations[shift:] + configurations[:shift]:
            if verbose:
                print(
                    f"round {round_index + 1}/{rounds}, {chunk} steps: "
                    f"{configuration.label}"
                )
            with _op_fusion(configuration.policy):
                configuration.train(x, y, batch_size, True, verbose)

    results = [
        _result(c, data, batch_size, units, warmup_steps)
        for c in configurations
    ]
    _add_comparisons(results)
    return results


# --- Reporting ---------------------------------------------------------------


def _format_row(result, with_ratio):
    def optional(value, pattern):
        return "-" if value is None else pattern.format(value)

    cells = [
        result["policy"],
        result["loop"],
        f"{result['median_ms']:.2f} ({result['q1_ms']:.2f}-"
        f"{result['q3_ms']:.2f})",
        optional(result["speedup_vs_float32"], "{:.2f}"),
        f"{result['samples_per_second']:.0f}",
        f"{result['final_loss']:.4f}",
        f"{100 * result['test_accuracy']:.1f}%",
        optional(result["final_loss_scale"], "{:g}"),
        optional(result["skipped_steps"], "{:d}"),
    ]
    if with_ratio:
        cells.append(optional(result["kmp_over_native"], "{:.2f}"))
    return cells


def _markdown_table(header, rows):
    widths = [
        max(len(row[i]) for row in [header] + rows) for i in range(len(header))
    ]

    def line(cells):
        padded = (cell.ljust(width) for cell, width in zip(cells, widths))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(header), rule] + [line(row) for row in rows])


def format_table(results: Sequence[Dict]) -> str:
    """Formats `run_benchmark`'s results as plain-text (Markdown) tables.

    The first table holds the kmp rows. When there are native rows, a second
    table holds them, with a `kmp / native` column: the kmp row's median step
    time over the native one's (above 1 means kmp is slower). Step times are
    medians with the interquartile range in parentheses.

    Args:
        results: The list `run_benchmark` returns (or loaded from its JSON).

    Returns:
        The tables and a short legend, as one string.

    Example:

    >>> print(format_table([]))
    No results.
    """
    kmp_rows = [r for r in results if r["implementation"] == "kmp"]
    native_rows = [r for r in results if r["implementation"] == "native"]
    if not results:
        return "No results."
    parts = []
    if kmp_rows:
        parts.append(
            "kmp (float16 compute uses kmp.LossScaleOptimizer; the other "
            "policies the plain optimizer):"
        )
        parts.append(
            _markdown_table(
                list(COLUMNS), [_format_row(r, False) for r in kmp_rows]
            )
        )
    if native_rows:
        parts.append(
            "\nnative Keras 3 (keras.optimizers.LossScaleOptimizer; the "
            "policies without loss scaling run the same code either way):"
        )
        parts.append(
            _markdown_table(
                list(COLUMNS) + [RATIO_COLUMN],
                [_format_row(r, True) for r in native_rows],
            )
        )
    first = results[0]
    parts.append(
        f"\nms/step: median (interquartile range) of {first['steps']} timed "
        f"steps per configuration, batch size {first['batch_size']}, "
        f"{first['units']} units. final loss: cross-entropy on the whole "
        "training set after training; test accuracy on the held-out 25%."
    )
    return "\n".join(parts)


def _speed_phrase(ratio, other):
    """`ratio` is the other configuration's step time over this one's."""
    if abs(ratio - 1.0) < _SAME_SPEED:
        return f"is about as fast as {other} ({ratio:.2f}x)"
    if ratio > 1.0:
        return f"is {ratio:.1f}x faster than {other}"
    return f"is {1.0 / ratio:.1f}x slower than {other}"


def _accuracy_phrase(accuracy, reference):
    points = 100 * (accuracy - reference)
    both = f"({100 * accuracy:.1f}% vs {100 * reference:.1f}%)"
    if abs(points) <= _SAME_ACCURACY_POINTS:
        return f"reaches the same accuracy {both}"
    direction = "higher" if points > 0 else "lower"
    return f"ends {abs(points):.1f} points {direction} in accuracy {both}"


def summarize(results: Sequence[Dict]) -> str:
    """Says in words what the table shows: speed-ups, accuracy, kmp's cost.

    Each mixed or low-precision policy is compared with float32 in the same
    loop (accuracies within 1 point count as the same), each kmp row with its
    native Keras twin, and skipped steps are explained.

    Args:
        results: The list `run_benchmark` returns.

    Returns:
        A few lines of text.

    Example:

    >>> summarize([])
    'No results.'
    """
    if not results:
        return "No results."
    lines = []
    by_key = {(r["policy"], r["loop"], r["implementation"]): r for r in results}
    kmp_rows = [r for r in results if r["implementation"] == "kmp"]
    slower_mixed = slow_float16_on_cpu = False
    for r in kmp_rows:
        if r["policy"] == "float32":
            continue
        reference = by_key.get(("float32", r["loop"], "kmp"))
        if reference is None:
            continue
        ratio = reference["median_ms"] / r["median_ms"]
        slower_mixed |= ratio <= 1.0 - _SAME_SPEED
        slow_float16_on_cpu |= (
            r["loss_scaling"] and r["device"] == "cpu" and ratio < 1 / 3
        )
        accuracy = _accuracy_phrase(
            r["test_accuracy"], reference["test_accuracy"]
        )
        lines.append(
            f"{_LOOP_WORDS[r['loop']]}: {r['policy']} "
            f"{_speed_phrase(ratio, 'float32')} here and {accuracy}."
        )
    if kmp_rows and not any(r["policy"] == "float32" for r in kmp_rows):
        lines.append("float32 was not benchmarked, so there is no speed-up.")
    for r in results:
        if r["implementation"] != "native" or r["kmp_over_native"] is None:
            continue
        mine = by_key[(r["policy"], r["loop"], "kmp")]
        ratio = r["kmp_over_native"]
        if abs(ratio - 1.0) < _SAME_SPEED:
            cost = "as long as"
        elif ratio > 1.0:
            cost = f"{100 * (ratio - 1):.0f}% longer than"
        else:
            cost = f"{100 * (1 - ratio):.0f}% less time than"
        lines.append(
            f"{_LOOP_WORDS[r['loop']]}: kmp's {r['policy']} steps take {cost} "
            f"native Keras 3's ({mine['median_ms']:.2f} vs "
            f"{r['median_ms']:.2f} ms/step), and kmp "
            f"{_accuracy_phrase(mine['test_accuracy'], r['test_accuracy'])}."
        )
    for r in results:
        skipped = r["skipped_steps"]
        if skipped:
            lines.append(
                f"{r['policy']} ({_LOOP_WORDS[r['loop']]}, "
                f"{r['implementation']}) skipped {skipped} "
                f"{'step' if skipped == 1 else 'steps'} with inf/NaN "
                "gradients while the loss scale settled (now "
                f"{r['final_loss_scale']:g}): loss scaling at work, not an "
                "error."
            )
    if slower_mixed:
        lines.append(
            "16-bit compute pays off where the hardware runs it natively "
            "and the model is large enough to be compute-bound (GPUs with "
            "tensor cores, TPUs, some recent CPUs); otherwise the casts cost "
            "more than they save."
        )
    if any(
        r["device"] == "cpu"
        and kmp.Policy(r["policy"]).compute_dtype == "float16"
        for r in results
    ):
        lines.append(FLOAT16_FUSION_NOTE)
    if slow_float16_on_cpu:
        lines.append(
            "float16 is especially slow on CPUs without float16 "
            "instructions (avx512_fp16 / amx_fp16); mixed_float16 is meant "
            "for GPUs: on a CPU, prefer mixed_bfloat16."
        )
    return "\n".join(lines)


# --- Output files ------------------------------------------------------------


def _machine_info():
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "kmp": kmp.__version__,
    }


def write_json(results, path, settings=None) -> None:
    """Writes the results, the settings and machine information as JSON."""
    document = {
        "machine": _machine_info(),
        "settings": dict(settings or {}),
        "results": list(results),
        "summary": summarize(results),
    }
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file, indent=2)
        file.write("\n")


def write_plot(results, path) -> None:
    """Plots loss curves and loss-scale trajectories into a PNG file."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter
    from matplotlib.ticker import LogLocator

    # A bare Figure on the Agg canvas leaves pyplot's global state alone.
    figure = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(figure)
    losses_axes, scales_axes = figure.subplots(1, 2)
    warmup = results[0]["warmup_steps"] if results else 0
    # Configurations often overlap exactly; dashes keep each line visible.
    styles = ("-", "--", "-.", ":")
    for index, r in enumerate(results):
        label = f"{r['policy']} / {r['loop']} / {r['implementation']}"
        style = styles[index % len(styles)]
        steps = np.arange(1, len(r["losses"]) + 1)
        losses_axes.plot(steps, r["losses"], style, label=label, linewidth=1.2)
        if r["loss_scales"]:
            scales_axes.step(
                steps, r["loss_scales"], style, where="post", label=label
            )
    for axes in (losses_axes, scales_axes):
        axes.axvline(warmup + 0.5, color="grey", linestyle=":", linewidth=1)
        axes.set_xlabel(f"training step (timed after step {warmup})")
    losses_axes.set_title("training loss per step")
    losses_axes.set_ylabel("cross-entropy")
    losses_axes.set_yscale("log")
    losses_axes.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    losses_axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    losses_axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    losses_axes.legend(fontsize="small")
    scales_axes.set_title("loss scale (loss-scaled configurations)")
    if any(r["loss_scales"] for r in results):
        scales_axes.set_yscale("log", base=2)
        scales_axes.legend(fontsize="small")
    else:
        scales_axes.text(
            0.5,
            0.5,
            "no loss-scaled configuration",
            ha="center",
            va="center",
            transform=scales_axes.transAxes,
        )
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)


# --- Command line ------------------------------------------------------------


def _names(allowed, what):
    def parse(text):
        names = tuple(name.strip() for name in text.split(","))
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(repr(n) for n in unknown)}; "
                f"choose from {', '.join(allowed)}"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(
                f"a {what} is listed twice: {text!r}"
            )
        return names

    return parse


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}"
        )
    return value


def _writable_path(suffix=None):
    def parse(text):
        path = os.path.abspath(os.path.expanduser(text))
        if suffix and not path.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(
                f"must be a {suffix} file name, got {text!r}"
            )
        directory = os.path.dirname(path)
        if os.path.isdir(path):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a directory; give a file name"
            )
        if not os.path.isdir(directory):
            raise argparse.ArgumentTypeError(
                f"cannot write {text!r}: directory {directory!r} does not exist"
            )
        writable = os.access(directory, os.W_OK) and (
            not os.path.exists(path) or os.access(path, os.W_OK)
        )
        if not writable:
            raise argparse.ArgumentTypeError(
                f"cannot write {text!r}: permission denied"
            )
        return path

    return parse


def _plot_path(text):
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "needs matplotlib, which is not installed: pip install 'kmp[bench]'"
        )
    return _writable_path(".png")(text)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `kmp bench` and its options on the `kmp` command line."""
    parser = subparsers.add_parser(
        "bench",
        help="time and compare policies on a small classifier",
        description=(
            "Train the same classifier on scikit-learn's digits under each "
            "policy, with model.fit and a custom GradientTape loop, and "
            "compare step time, loss, accuracy and loss scaling. Steps are "
            "timed one by one, after warm-up, in interleaved rounds; the "
            "table shows medians with the interquartile range. The defaults "
            "take one to two minutes on a 2-core CPU."
        ),
    )
    parser.add_argument(
        "--policies",
        type=_names(POLICY_NAMES, "policy"),
        default=",".join(DEFAULT_POLICIES),
        metavar="P1,P2",
        help="comma-separated policies, from "
        f"{', '.join(POLICY_NAMES)} (default: %(default)s)",
    )
    parser.add_argument(
        "--loops",
        type=_names(LOOPS, "loop"),
        default=",".join(LOOPS),
        metavar="fit,custom",
        help="training loops to run (default: %(default)s)",
    )
    for flag, default, text in (
        ("--steps", DEFAULT_STEPS, "timed training steps per configuration"),
        ("--batch-size", DEFAULT_BATCH_SIZE, "examples per step"),
        ("--units", DEFAULT_UNITS, "width of the two hidden layers"),
        (
            "--rounds",
            DEFAULT_ROUNDS,
            "interleaved rounds the steps are split into",
        ),
        (
            "--warmup",
            DEFAULT_WARMUP_STEPS,
            "untimed steps per configuration before timing",
        ),
    ):
        parser.add_argument(
            flag,
            type=_positive_int,
            default=default,
            metavar="N",
            help=f"{text} (default: %(default)s)",
        )
    parser.add_argument(
        "--no-native",
        dest="native",
        action="store_false",
        help="skip the comparison with Keras 3's own LossScaleOptimizer",
    )
    parser.add_argument(
        "--json",
        type=_writable_path(),
        metavar="FILE",
        help="also write every measurement and machine information as JSON",
    )
    parser.add_argument(
        "--plot",
        type=_plot_path,
        metavar="FILE.png",
        help="also plot loss curves and loss-scale trajectories (matplotlib)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bars, only results"
    )
    parser.set_defaults(func=run, bench_parser=parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Runs `kmp bench` with parsed arguments; prints tables and summary."""
    if args.rounds > args.steps:
        args.bench_parser.error(
            f"argument --rounds: must be at most --steps ({args.steps}), "
            f"got {args.rounds}"
        )
    if importlib.util.find_spec("sklearn") is None:
        print(
            "kmp bench needs scikit-learn for its data set: "
            "pip install 'kmp[bench]'",
            file=sys.stderr,
        )
        return 1
    started = time.perf_counter()
    results = run_benchmark(
        policies=args.policies,
        loops=args.loops,
        steps=args.steps,
        batch_size=args.batch_size,
        units=args.units,
        rounds=args.rounds,
        native=args.native,
        warmup_steps=args.warmup,
        verbose=not args.quiet,
    )
    wall_seconds = time.perf_counter() - started
    print()
    print(format_table(results))
    print()
    print(summarize(results))
    print(f"\nWall time: {wall_seconds:.0f} s.")
    if args.json:
        settings = {
            "policies": list(args.policies),
            "loops": list(args.loops),
            "steps": args.steps,
            "batch_size": args.batch_size,
            "units": args.units,
            "rounds": args.rounds,
            "warmup_steps": args.warmup,
            "native": args.native,
            "wall_seconds": wall_seconds,
        }
        write_json(results, args.json, settings)
        print(f"Wrote {args.json}")
    if args.plot:
        write_plot(results, args.plot)
        print(f"Wrote {args.plot}")
    return 0
