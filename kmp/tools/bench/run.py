"""`kmp bench`: how fast and how well each dtype policy trains, measured fairly.

The same model trains under every requested policy, with `model.fit`'s
train step and with the custom loop of Keras's backend: a `tf.function`
around a `tf.GradientTape` on TensorFlow, the jitted `stateless_apply`
loop on JAX, the `backward()` loop on torch (`kmp.tools.bench.tensorflow`,
`jax`, `torch`). By default the model is the digits classifier (Dense ->
Dense -> Dense logits -> a float32 softmax on scikit-learn's digits);
`mlp`, `cnn` and `transformer` are sized for a GPU (`bench.models`).

Policies that compute in float16 use `kmp.LossScaleOptimizer`; the others
the plain optimizer. float32 matmuls and convolutions run at full float32
precision in every configuration (on NVIDIA GPUs JAX and TensorFlow would
use TF32 by default, and torch for cuDNN's convolutions), so a speed-up is
never measured against a TF32 baseline; each result records it. With
`native=True` the loss-scaled configurations run a second time with
Keras 3's own `keras.optimizers.LossScaleOptimizer`, so
kmp's cost shows as a ratio; with `overhead=True` they run a third time
without loss scaling, so what loss scaling costs shows too. On torch plain
PyTorch AMP (`torch.autocast`, `torch.amp.GradScaler`) trains the same
network beside them (`torch_amp=True`).

Building the configurations, the first call of each step (tracing and
compilation) and the warm-up steps after it are not timed: they are
reported on a line of their own and are not part of the time budget. On
JAX, compiled steps are kept in JAX's persistent compilation cache
(`bench.jax.enable_compilation_cache`), so a second run compiles less.

The timed steps run in interleaved rounds whose order rotates (at least
`bench_stats.MIN_ROUNDS` rounds of `bench_stats.MIN_ROUND_STEPS` steps per
configuration, never fewer), each round in blocks of steps dispatched back
to back with one wait for the device per block (`bench.rounds`). The
tables show each configuration's median block time per step with the
interquartile range, and every ratio with a 95% interval from a seeded
bootstrap over rounds and blocks (`bench.stats`), flagged when it is wider
than 10% of the ratio. Every configuration trains on the same batches in
the same order, the same number of steps, from the same weights.

Without a fixed number of steps the timed rounds and the evaluation fit a
time budget (`DEFAULT_BUDGET_SECONDS`), planned on the step times the
warm-up measured (`plan_steps`); when even the fewest steps do not fit,
the run says so and takes longer.
"""

import sys
import time
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Union

import keras
import numpy as np

from kmp.core import backend
from kmp.core.policy import POLICY_NAMES
from kmp.tools.bench import models as bench_models
from kmp.tools.bench import plan as bench_plan
from kmp.tools.bench import rounds as bench_rounds
from kmp.tools.bench import stats as bench_stats
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
# The timed rounds and the evaluation, when the steps are not fixed (the
# building, compilation and warm-up before them come on top).
DEFAULT_BUDGET_SECONDS = 90.0
# Each configuration's warm-up steps stop after this share of the budget
# over the configurations (at least one runs).
_WARMUP_SHARE = 0.25
DEFAULT_ROUNDS = bench_stats.MIN_ROUNDS
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


def _interactive():
    stdout = sys.stdout
    return bool(getattr(stdout, "isatty", None) and stdout.isatty())


class _Progress:
    """A Keras progress bar with the time left, or nothing when quiet.

    As Keras's `fit` does: the bar is redrawn as it moves on a terminal;
    into a file or a pipe (a log, CI) it prints one line when it is done.
    """

    def __init__(self, verbose):
        self._verbose = verbose
        self._bar = None

    def say(self, text):
        if self._verbose:
            print(text, flush=True)

    def start(self, target, unit):
        if self._verbose:
            self._bar = keras.utils.Progbar(
                target, unit_name=unit, verbose=1 if _interactive() else 2
            )

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
    blocks = configuration.block_seconds
    every = np.array([t for round_ in blocks for t in round_]) * 1000.0
    low, q1, median, q3, high = np.percentile(every, [0, 25, 50, 75, 100])
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
        "learning_rate": spec.learning_rate,
        "warmup_steps": warmed.warmup_steps,
        "build_seconds": configuration.build_seconds,
        "first_call_seconds": warmed.trace_seconds,
        "warmup_seconds": configuration.warmup_seconds,
        "warmup_ms": warmed.warmup_last * 1000.0,
        "rounds": len(blocks),
        "blocks_per_round": len(blocks[0]),
        "steps": configuration.timed_steps,
        "block_times_ms": [
            [seconds * 1000.0 for seconds in round_] for round_ in blocks
        ],
        "median_ms": float(median),
        "q1_ms": float(q1),
        "q3_ms": float(q3),
        "min_ms": float(low),
        "max_ms": float(high),
        "samples_per_second": batch_size / (median / 1000.0),
        **{key: None for key in RATIOS},
        **{f"{key}_ci": None for key in RATIOS},
        "peak_memory_mb": None if peak is None else peak / 2**20,
        "state_mb": configuration.state_bytes() / 2**20,
        "final_loss": _cross_entropy(train_probabilities, y_train),
        "test_accuracy": accuracy,
        "losses": list(configuration.losses),
        "loss_scales": list(configuration.loss_scales) if scaled else None,
        "final_loss_scale": configuration.current_loss_scale()
        if scaled
        else None,
        "skipped_steps": configuration.skipped_steps() if scaled else None,
        "skipped_at": list(configuration.skipped_at) if scaled else None,
        # Read from the framework while the run holds it (`full_float32`).
        "float32_matmuls": backend_module().float32_matmuls(),
    }


def _side(result):
    """Keras's side or plain PyTorch's: each has its own float32 row."""
    return "torch" if result["implementation"].startswith("torch") else "keras"


# The ratios `add_comparisons` fills in.
RATIOS = (
    "speedup_vs_float32",
    "kmp_over_native",
    "kmp_over_torch",
    "loss_scaling_overhead",
)


def add_comparisons(results: List[Dict]) -> None:
    """Fills in the ratios, each with its 95% interval.

    The speed-up over float32 (on the same side, Keras's or plain
    PyTorch's, in the same loop), kmp / native and kmp / PyTorch AMP on
    those rows, and on loss-scaled rows their step time over the same
    policy's without loss scaling, minus one. A ratio's interval
    (`<ratio>_ci`, `[low, high]`) comes from `bench_stats.ratio_interval`
    on the two rows' `block_times_ms`; None where a row has none (results
    made by hand).
    """
    float32, kmp_rows, unscaled = {}, {}, {}
    for r in results:
        side = _side(r)
        if r["policy"] == "float32" and r["implementation"] in ("kmp", "torch"):
            float32[(side, r["loop"])] = r
        if r["implementation"] == "kmp":
            kmp_rows[(r["policy"], r["loop"])] = r
        if r["implementation"] in ("unscaled", "torch_unscaled"):
            unscaled[(side, r["policy"], r["loop"])] = r
    for r in results:
        side, key = _side(r), (r["policy"], r["loop"])
        reference = float32.get((side, r["loop"]))
        if reference is not None:
            _compare(r, "speedup_vs_float32", reference, r)
        mine = kmp_rows.get(key)
        if mine is not None and r["implementation"] == "native":
            _compare(r, "kmp_over_native", mine, r)
        if mine is not None and r["implementation"] == "torch":
            _compare(r, "kmp_over_torch", mine, r)
        other = unscaled.get((side, *key))
        if r.get("loss_scaling") and other is not None:
            _compare(r, "loss_scaling_overhead", r, other, offset=-1.0)


def _compare(row, key, numerator, denominator, offset=0.0):
    """`row[key]`: numerator's step time over denominator's (plus
    `offset`), and `row[key + "_ci"]`, its interval."""
    row[key] = numerator["median_ms"] / denominator["median_ms"] + offset
    a = numerator.get("block_times_ms")
    b = denominator.get("block_times_ms")
    interval = None
    if a and b and numerator is denominator:
        interval = [1.0 + offset, 1.0 + offset]
    elif a and b:
        low, high = bench_stats.ratio_interval(a, b)
        interval = [low + offset, high + offset]
    row[f"{key}_ci"] = interval


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
    compilation_cache: Union[str, bool] = True,
    low_precision: bool = False,
) -> List[Dict]:
    """Trains `model` under each policy and loop, and times it.

    Builds every configuration (`plan_configurations`), warms each up with
    its first call (tracing, compiling) and up to `warmup_steps` more
    untimed steps, then runs the timed steps of each in interleaved rounds
    of blocks, one device sync per block (`bench.rounds`). With `steps`
    that is `steps` timed steps in `rounds` rounds and exactly
    `warmup_steps` warm-up steps; without, the timed rounds and the
    evaluation fit in about `budget_seconds` (the building, compiling and
    warm-up come first, on top), planned on the step times the warm-up
    measured (`plan_steps`), and never fewer than
    `bench_stats.MIN_ROUND_STEPS` steps per round. Changes no global state
    but JAX's compilation cache folder (`compilation_cache`): policies are
    set with `kmp.policy_scope` while each model is built, and float32
    matmuls and convolutions run at full float32 precision during the run
    (TF32 off: the backend module's `full_float32`), in every row, so that
    on a GPU no speed-up is measured against a TF32 baseline; the settings
    are restored after it.

    Args:
        policies: Policy names, from `kmp.core.policy.POLICY_NAMES`.
        loops: `"fit"` and/or `"custom"`.
        steps: Timed training steps per configuration, at least
            `bench_stats.MIN_ROUND_STEPS` per round; None: from the budget.
        batch_size: Examples per step (None: the model's).
        units: The model's width (None: the model's; see `bench.models`).
        rounds: Interleaved rounds, at least `bench.stats.MIN_ROUNDS`.
        native: Also run the loss-scaled policies with
            `keras.optimizers.LossScaleOptimizer`.
        warmup_steps: Untimed steps per configuration after its first call
            and before the rounds (the most, without `steps`).
        verbose: Print what runs, with progress bars and the time left
            (redrawn on a terminal, one line per bar otherwise).
        model: One of `bench_models.MODELS`.
        size: One of `bench_models.SIZES` (`"auto"`: `"large"` on a GPU).
        budget_seconds: The time the timed rounds and the evaluation should
            take without `steps`.
        overhead: Also run the loss-scaled policies without loss scaling
            (and, on torch, plain PyTorch AMP without `GradScaler`).
        torch_amp: On torch, also train with plain PyTorch AMP.
        memory: Measure each configuration's peak device memory (see the
            backend modules; on a CPU only JAX measures it).
        compilation_cache: On JAX, where compiled steps are kept between
            runs: True for `bench.jax.compilation_cache_dir()`, a folder,
            or False for no cache. A folder JAX was already given is kept.
        low_precision: Also train bfloat16 weights with
            `kmp.LowPrecisionOptimizer`, with bfloat16 moments (`state16`)
            and 8-bit moments (`state8`).

    Returns:
        One dict per configuration, in the order of `plan_configurations`.
        Keys: `policy`, `loop`, `implementation`, `loss_scaling`, `device`,
        `model`, `size`, `block_times_ms` (per round, every timed block's
        time per step), `median_ms`, `q1_ms`, `q3_ms`, `min_ms`, `max_ms`
        (over the blocks), `samples_per_second`, the ratios of
        `add_comparisons` and their intervals (None where they do not
        apply), `peak_memory_mb`, `final_loss` (cross-entropy on the whole
        training set after training), `test_accuracy` (a fraction),
        `losses` (every step's batch loss, untimed steps included),
        `loss_scales`, `final_loss_scale`, `skipped_steps` (None without
        loss scaling), `state_mb` (weights and optimizer state), and the
        settings `batch_size`, `units`, `learning_rate`, `warmup_steps`,
        `rounds`, `blocks_per_round`, `steps`, `build_seconds`,
        `first_call_seconds`, `warmup_seconds`, `warmup_ms`, and
        `float32_matmuls` (`"float32"`: full precision, read from the
        framework during the run).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an unknown policy, loop, model or size, a count below
            1, fewer rounds or steps than `bench_stats.check_counts`
            allows; the transformer under a float16 policy on JAX's CPU
            backend (which Keras's attention does not support).
        ImportError: the digits need scikit-learn.

    Example:

    >>> results = run_benchmark(
    ...     ["float32"], ["custom"], steps=100, batch_size=8, units=4,
    ...     warmup_steps=1, verbose=False, torch_amp=False)
    >>> [(r["policy"], r["loop"], r["steps"], r["rounds"], len(r["losses"]))
    ...  for r in results]
    [('float32', 'custom', 100, 5, 107)]
    """
    policies = _check_names(policies, POLICY_NAMES, "policies")
    loops = _check_names(loops, LOOPS, "loops")
    counts = {"rounds": rounds, "warmup_steps": warmup_steps}
    counts.update(steps=steps, batch_size=batch_size, units=units)
    for argument, value in counts.items():
        if value is not None or argument == "rounds":
            _check_count(value, argument)
    budget_seconds = _check_budget(budget_seconds)
    too_few = bench_stats.check_counts(
        bench_stats.MIN_STEPS * rounds if steps is None else steps, rounds
    )
    if too_few:
        raise ValueError(f"{too_few} Received: steps={steps}, rounds={rounds}")
    module = backend_module()
    device = module.device()
    if compilation_cache is not False and hasattr(
        module, "enable_compilation_cache"
    ):
        module.enable_compilation_cache(
            None if compilation_cache is True else compilation_cache
        )
    # Every row, the float32 baseline's included, at full float32
    # precision: never measured against a TF32 one on a GPU.
    with module.full_float32():
        spec = bench_models.model_spec(
            model, size, units, batch_size, gpu=device == "gpu"
        )
        problem = unsupported(spec.name, policies)
        if problem:
            raise ValueError(
                f"{problem} Received: policies={tuple(policies)!r}"
            )
        data = bench_models.load_data(spec)
        x_train, _, y_train, _ = data
        batches = bench_models.Batches(x_train, y_train, spec.batch_size)
        plan = plan_configurations(
            policies, loops, native, overhead, torch_amp, device, low_precision
        )
        progress = _Progress(verbose)
        progress.say(
            f"kmp bench: {bench_models.describe(spec)}; Keras on "
            f"{backend.name()} ({device}); {_count(len(plan), 'configuration')}"
            f"; float32 matmuls and convolutions: {module.float32_matmuls()}."
        )
        if steps is None:
            progress.say(
                f"Time budget for the timed steps: {budget_seconds:g} s "
                "(--budget); building, compiling and warming up come first, "
                "on top of it."
            )
        progress.say(
            "Building, compiling and warming up every configuration..."
        )
        progress.start(len(plan), "configuration")
        started = time.perf_counter()
        configurations = []
        for p, loop, implementation in plan:
            built = time.perf_counter()
            configuration = Configuration(
                p, loop, implementation, spec, batches, memory
            )
            configuration.build_seconds = _since(built)
            configurations.append(configuration)
        build_seconds = _since(started)
        walls = bench_plan.StepWalls()
        warm_started = [time.perf_counter()]

        def warmed_up(configuration, timed):
            configuration.warmup_seconds = (
                _since(warm_started[0]) - timed.trace_seconds
            )
            warm_started[0] = time.perf_counter()
            progress.advance()

        timings = timing.warm_up_all(
            configurations,
            warmup_min=warmup_steps if steps is not None else 1,
            warmup_max=warmup_steps,
            context=module.context,
            observe=walls.observe,
            warmed_up=warmed_up,
            max_seconds=None
            if steps is not None
            else _WARMUP_SHARE * budget_seconds / len(plan),
        )
        progress.say(_warmup_line(configurations, timings, build_seconds))
        seconds = walls.per_step(timings)
        if steps is None:
            steps, fits = bench_plan.steps_for_budget(
                seconds, data, spec, budget_seconds, rounds
            )
            if not fits:
                progress.say(
                    f"The budget ({budget_seconds:g} s) cannot hold "
                    f"{bench_stats.MIN_ROUNDS} rounds of "
                    f"{bench_stats.MIN_ROUND_STEPS} timed steps per "
                    "configuration, the fewest kmp bench times: timing them "
                    "anyway, which takes about "
                    f"{bench_plan.minimum_seconds(seconds, rounds):.0f} s "
                    "(fewer policies or a smaller model take less)."
                )
        per_round = bench_stats.round_steps(steps, rounds)
        blocks = bench_stats.blocks_per_round(min(per_round))
        block = bench_stats.block_sizes(per_round[0], blocks)[0]
        progress.say(
            f"Timing {_count(steps, 'step')} per configuration in "
            f"{_count(rounds, 'round')} of {_count(blocks, 'block')} (about "
            f"{_count(block, 'step')} each, one device sync per block): about "
            f"{(steps + rounds) * sum(seconds):.0f} s."
        )
        progress.start(len(plan) * (steps + rounds), "step")
        bench_rounds.time_rounds(
            configurations,
            steps,
            rounds,
            context=module.context,
            advance=progress.advance,
        )
        results = [
            _result(c, data, spec, timings[c.label], device)
            for c in configurations
        ]
        add_comparisons(results)
        return results


def _warmup_line(configurations, timings, build_seconds):
    """Compilation and warm-up, on their own line."""
    first = sum(t.trace_seconds for t in timings.values())
    steps = sum(t.warmup_steps for t in timings.values())
    warm = sum(c.warmup_seconds for c in configurations)
    total = build_seconds + first + warm
    return (
        f"Compilation and warm-up (untimed, not in the budget): {total:.1f} "
        f"s: building {build_seconds:.1f} s, first calls (tracing, "
        f"compiling) {first:.1f} s, {_count(steps, 'warm-up step')} "
        f"{warm:.1f} s."
    )


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
