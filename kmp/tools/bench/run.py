"""`kmp bench`: how fast and how well each dtype policy trains, measured fairly.

The same model trains under every requested policy, with `model.fit`'s
train step and with the custom loop of Keras's backend: a `tf.function`
around a `tf.GradientTape` on TensorFlow, the jitted `stateless_apply`
loop on JAX, the `backward()` loop on torch (`kmp.tools.bench.tensorflow`,
`jax`, `torch`). By default the model is the digits classifier (Dense ->
Dense -> Dense logits -> a float32 softmax on scikit-learn's digits);
`mlp`, `cnn` and `transformer` are sized for a GPU (`bench.models`).

Policies that compute in float16 use `kmp.LossScaleOptimizer`; the others
the plain optimizer. With `native=True` the loss-scaled configurations run
a second time with Keras 3's own `keras.optimizers.LossScaleOptimizer`, so
kmp's cost shows as a ratio; with `overhead=True` they run a third time
without loss scaling, so what loss scaling costs shows too. On torch plain
PyTorch AMP (`torch.autocast`, `torch.amp.GradScaler`) trains the same
network beside them (`torch_amp=True`).

Steps are timed by `bench.timing` (the toolkit `benchmarks/` uses too):
every configuration is warmed up first (tracing and the first steps are not
timed), then the timed steps run in interleaved rounds whose order rotates,
each step timed on its own up to reading its loss; the tables show medians
with the interquartile range. Every configuration trains on the same
batches in the same order, the same number of steps, from the same weights.

Without a fixed number of steps the run fits a time budget (two minutes by
default): after the warm-up, the step times measured there decide how many
steps fit in what is left (`plan_steps`).
"""

import time
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

import keras
import numpy as np

from kmp.core import backend
from kmp.core.policy import POLICY_NAMES
from kmp.tools.bench import models as bench_models
from kmp.tools.bench import plan as bench_plan
from kmp.tools.bench import timing
from kmp.tools.bench.configuration import Configuration
from kmp.tools.bench.configuration import backend_module
from kmp.tools.bench.configuration import needs_loss_scaling
from kmp.tools.bench.plan import MAX_BUDGET_STEPS
from kmp.tools.bench.plan import plan_configurations
from kmp.tools.bench.plan import plan_steps
from kmp.tools.bench.report import LOOPS

DEFAULT_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
DEFAULT_MODEL = "digits"
DEFAULT_SIZE = "auto"
# The whole run, from loading the data to the evaluation, when the steps
# are not fixed; the warm-up may take a quarter of it.
DEFAULT_BUDGET_SECONDS = 120.0
_WARMUP_SHARE = 0.25
# The most timing rounds; fewer when few steps fit (each round costs every
# configuration one untimed step).
DEFAULT_ROUNDS = 5
DEFAULT_WARMUP_STEPS = 10


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


def _check_budget(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            "'budget_seconds' must be a number of seconds > 0. Received: "
            f"budget_seconds={value!r} of type {type(value).__name__}"
        )
    if not value > 0:
        raise ValueError(
            "'budget_seconds' must be a number of seconds > 0. Received: "
            f"budget_seconds={value!r}"
        )
    return float(value)


# --- Progress -----------------------------------------------------------------


class _Progress:
    """A Keras progress bar with the time left, or nothing when quiet."""

    def __init__(self, verbose):
        self._verbose = verbose
        self._bar = None

    def say(self, text):
        if self._verbose:
            print(text, flush=True)

    def start(self, target, unit):
        if self._verbose:
            self._bar = keras.utils.Progbar(target, unit_name=unit)

    def advance(self, count=1):
        if self._bar is not None:
            self._bar.add(count)


# --- Results ------------------------------------------------------------------


def _cross_entropy(probabilities, labels):
    picked = probabilities[np.arange(len(labels)), labels].astype("float64")
    return float(-np.mean(np.log(np.clip(picked, 1e-7, 1.0))))


def _predict(model, x, batch_size):
    chunk = max(4 * batch_size, 2048)
    return np.concatenate(
        [
            keras.ops.convert_to_numpy(
                model(x[start : start + chunk], training=False)
            )
            for start in range(0, len(x), chunk)
        ]
    )


def _result(configuration, data, spec, warmed, device):
    x_train, x_test, y_train, y_test = data
    configuration.finish()
    model, batch_size = configuration.model, spec.batch_size
    train_probabilities = _predict(model, x_train, batch_size)
    test_probabilities = _predict(model, x_test, batch_size)
    accuracy = float(np.mean(test_probabilities.argmax(axis=1) == y_test))
    measured = timing.Timing(
        configuration.label, times=configuration.step_seconds
    )
    low, q1, median, q3, high = (t * 1000.0 for t in measured.quantiles())
    scaled = configuration.loss_scaled
    peak = configuration.peak_bytes
    return {
        "policy": configuration.policy,
        "loop": configuration.loop,
        "implementation": configuration.implementation,
        "loss_scaling": scaled,
        "backend": backend.name(),
        "device": device,
        "model": spec.name,
        "size": spec.size,
        "batch_size": batch_size,
        "units": spec.width,
        "warmup_steps": warmed.warmup_steps,
        "first_call_seconds": warmed.trace_seconds,
        "warmup_ms": warmed.warmup_last * 1000.0,
        "rounds": len(warmed.round_medians),
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
        "kmp_over_torch": None,
        "loss_scaling_overhead": None,
        "peak_memory_mb": None if peak is None else peak / 2**20,
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


def _side(result):
    """Keras's side or plain PyTorch's: each has its own float32 row."""
    return "torch" if result["implementation"].startswith("torch") else "keras"


def add_comparisons(results: List[Dict]) -> None:
    """Fills in the ratios: the speed-up over float32 (on the same side,
    Keras's or plain PyTorch's, in the same loop), kmp / native and kmp /
    PyTorch AMP on those rows, and on loss-scaled rows their step time over
    the same policy's without loss scaling, minus one."""
    float32_ms, kmp_ms, unscaled_ms = {}, {}, {}
    for r in results:
        side = _side(r)
        if r["policy"] == "float32" and r["implementation"] in ("kmp", "torch"):
            float32_ms[(side, r["loop"])] = r["median_ms"]
        if r["implementation"] == "kmp":
            kmp_ms[(r["policy"], r["loop"])] = r["median_ms"]
        if r["implementation"] in ("unscaled", "torch_unscaled"):
            unscaled_ms[(side, r["policy"], r["loop"])] = r["median_ms"]
    for r in results:
        side, key = _side(r), (r["policy"], r["loop"])
        reference = float32_ms.get((side, r["loop"]))
        if reference is not None:
            r["speedup_vs_float32"] = reference / r["median_ms"]
        mine = kmp_ms.get(key)
        if mine is not None and r["implementation"] == "native":
            r["kmp_over_native"] = mine / r["median_ms"]
        if mine is not None and r["implementation"] == "torch":
            r["kmp_over_torch"] = mine / r["median_ms"]
        unscaled = unscaled_ms.get((side, *key))
        if r.get("loss_scaling") and unscaled is not None:
            r["loss_scaling_overhead"] = r["median_ms"] / unscaled - 1.0


# --- The benchmark ------------------------------------------------------------


def run_benchmark(
    policies: Sequence[str] = DEFAULT_POLICIES,
    loops: Sequence[str] = LOOPS,
    steps: Optional[int] = None,
    batch_size: Optional[int] = None,
    units: Optional[int] = None,
    rounds: int = DEFAULT_ROUNDS,
    native: bool = True,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    verbose: bool = True,
    model: str = DEFAULT_MODEL,
    size: str = DEFAULT_SIZE,
    budget_seconds: float = DEFAULT_BUDGET_SECONDS,
    overhead: bool = False,
    torch_amp: bool = True,
    memory: bool = False,
) -> List[Dict]:
    """Trains `model` under each policy and loop, and times it.

    Builds every configuration (`plan_configurations`), warms each up with
    its first call and up to `warmup_steps` more untimed steps, then runs
    the timed steps of each in interleaved rounds, each round starting each
    configuration with one untimed step (`bench.timing`). With `steps`
    that is `steps` timed steps in `rounds` rounds and exactly
    `warmup_steps` warm-up steps; without, the whole run fits in about
    `budget_seconds`: the warm-up stops early if it would take more than a
    quarter of it, and `plan_steps` decides the steps and rounds (at most
    `rounds`) from the step times it measured. Changes no global state:
    policies are set with `kmp.policy_scope` while each model is built.

    Args:
        policies: Policy names, from `kmp.core.policy.POLICY_NAMES`.
        loops: `"fit"` and/or `"custom"`.
        steps: Timed training steps per configuration; None: from the
            budget.
        batch_size: Examples per step (None: the model's).
        units: The model's width (None: the model's; see `bench.models`).
        rounds: Interleaved rounds (the most rounds without `steps`); at
            most `steps`.
        native: Also run the loss-scaled policies with
            `keras.optimizers.LossScaleOptimizer`.
        warmup_steps: Untimed steps per configuration after its first call
            and before the rounds (the most, without `steps`).
        verbose: Print what runs, with progress bars and the time left.
        model: One of `bench_models.MODELS`.
        size: One of `bench_models.SIZES` (`"auto"`: `"large"` on a GPU).
        budget_seconds: The time the whole run should take without `steps`.
        overhead: Also run the loss-scaled policies without loss scaling
            (and, on torch, plain PyTorch AMP without `GradScaler`).
        torch_amp: On torch, also train with plain PyTorch AMP.
        memory: Measure each configuration's peak device memory (see the
            backend modules; on a CPU only JAX measures it).

    Returns:
        One dict per configuration, in the order of `plan_configurations`.
        Keys: `policy`, `loop`, `implementation`, `loss_scaling`, `device`,
        `model`, `size`, `step_times_ms` (every timed step), `median_ms`,
        `q1_ms`, `q3_ms`, `min_ms`, `max_ms`, `samples_per_second`, the
        ratios of `add_comparisons` (None where they do not apply),
        `peak_memory_mb`, `final_loss` (cross-entropy on the whole training
        set after training), `test_accuracy` (a fraction), `losses` (every
        step's batch loss, untimed steps included), `loss_scales`,
        `final_loss_scale`, `skipped_steps` (None without loss scaling), and
        the settings `batch_size`, `units`, `warmup_steps`, `rounds`,
        `steps`, `first_call_seconds`, `warmup_ms`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an unknown policy, loop, model or size, a count below
            1, or more rounds than steps; the transformer under a float16
            policy on JAX's CPU backend (which Keras's attention does not
            support).
        ImportError: the digits need scikit-learn.

    Example:

    >>> results = run_benchmark(
    ...     ["float32"], ["custom"], steps=2, batch_size=8, units=4,
    ...     rounds=1, warmup_steps=1, verbose=False, torch_amp=False)
    >>> [(r["policy"], r["loop"], r["steps"], len(r["losses"]))
    ...  for r in results]
    [('float32', 'custom', 2, 5)]
    """
    started = time.perf_counter()
    policies = _check_names(policies, POLICY_NAMES, "policies")
    loops = _check_names(loops, LOOPS, "loops")
    counts = {"rounds": rounds, "warmup_steps": warmup_steps}
    counts.update(steps=steps, batch_size=batch_size, units=units)
    for argument, value in counts.items():
        if value is not None or argument == "rounds":
            _check_count(value, argument)
    budget_seconds = _check_budget(budget_seconds)
    if steps is not None and rounds > steps:
        raise ValueError(
            "'rounds' must be at most 'steps': every round runs at least one "
            f"step. Received: rounds={rounds}, steps={steps}"
        )
    module = backend_module()
    device = module.device()
    spec = bench_models.model_spec(
        model, size, units, batch_size, gpu=device == "gpu"
    )
    problem = unsupported(spec.name, policies)
    if problem:
        raise ValueError(f"{problem} Received: policies={tuple(policies)!r}")
    data = bench_models.load_data(spec)
    x_train, _, y_train, _ = data
    # The first call, the warm-up, one untimed step per round, the timed.
    needed = None if steps is None else 1 + warmup_steps + rounds + steps
    batches = bench_models.Batches(
        x_train, y_train, spec.batch_size, max_batches=needed or 512
    )
    plan = plan_configurations(
        policies, loops, native, overhead, torch_amp, device
    )
    progress = _Progress(verbose)
    progress.say(
        f"kmp bench: {bench_models.describe(spec)}; Keras on "
        f"{backend.name()} ({device}); {_count(len(plan), 'configuration')}."
    )
    if steps is None:
        progress.say(
            f"Time budget: {budget_seconds:.0f} s (--budget); the steps "
            "follow from the warm-up (--steps fixes them)."
        )
    progress.say("Building and warming up every configuration...")
    progress.start(len(plan), "configuration")
    configurations = [
        Configuration(p, loop, implementation, spec, batches, memory)
        for p, loop, implementation in plan
    ]
    walls = bench_plan.StepWalls()
    timings = timing.warm_up_all(
        configurations,
        warmup_min=warmup_steps if steps is not None else 1,
        warmup_max=warmup_steps,
        context=module.context,
        observe=walls.observe,
        warmed_up=lambda c, t: progress.advance(),
        max_seconds=None
        if steps is not None
        else _WARMUP_SHARE * budget_seconds / len(plan),
    )
    if steps is None:
        seconds = walls.per_step(timings)
        steps, rounds = bench_plan.steps_for_budget(
            seconds, data, spec, budget_seconds - _since(started), rounds
        )
        progress.say(
            f"Warm-up done after {_since(started):.0f} s. Timing "
            f"{_count(steps, 'step')} per configuration in "
            f"{_count(rounds, 'round')}: about "
            f"{(steps + rounds) * sum(seconds):.0f} s more."
        )
    progress.start(len(plan) * (steps + rounds), "step")

    def observe(configuration, loss, seconds, timed):
        configuration.record(loss, seconds, timed)
        progress.advance()

    timing.time_rounds(
        configurations,
        timings,
        rounds,
        timing.chunks(steps, rounds),
        context=module.context,
        observe=observe,
    )
    results = [
        _result(c, data, spec, timings[c.label], device) for c in configurations
    ]
    add_comparisons(results)
    return results


def unsupported(model, policies) -> Optional[str]:
    """Why `model` cannot train under `policies` here, or None.

    On JAX's CPU backend Keras's attention cannot compute in float16.
    """
    float16 = [p for p in policies if needs_loss_scaling(p)]
    if model == "transformer" and float16 and backend.is_jax():
        if backend_module().device() == "cpu":
            return (
                "On JAX's CPU backend Keras's attention cannot compute in "
                "float16 (XLA's CPU dot has no float16 x float16 -> "
                "float32), so the transformer cannot run under "
                f"{', '.join(float16)} here: it needs a GPU."
            )
    return None


def _since(started):
    return time.perf_counter() - started


def _count(number, word):
    return f"{number} {word}{'' if number == 1 else 's'}"


__all__ = [
    "DEFAULT_BUDGET_SECONDS",
    "DEFAULT_MODEL",
    "DEFAULT_POLICIES",
    "MAX_BUDGET_STEPS",
    "add_comparisons",
    "plan_configurations",
    "plan_steps",
    "run_benchmark",
    "unsupported",
]
