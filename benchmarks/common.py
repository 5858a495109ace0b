"""Shared pieces of the kmp benchmarks: models, steps, timing, tables.

Every benchmark compares configurations of one model inside one process:

* `build_config` makes a model under a policy, an optimizer and one training
  step (a `tf.function` call: a custom loop, or the train function `fit` runs
  per batch), returning a `Config`.
* `measure` times them with `kmp.tools.bench.timing`, the toolkit `kmp bench`
  uses too: it traces and warms every configuration up first (tracing and
  the slow steps right after it are never timed), then runs rounds: in each
  round every configuration runs a few steps, one after another, in an
  order that rotates from round to round, so a machine that slows down or
  speeds up affects all of them alike. Every step is timed on its own and
  synchronised by fetching its loss.
* `Timing` keeps the step times; `ratio` compares two configurations round by
  round, which cancels slow drift of the machine; `print_machine` and
  `print_table` print the results with what they were measured on.

Generated data only: nothing is downloaded.

Example (from a script in this folder):

    args = common.parse_args(parser)
    configs = [
        common.build_config("float32", "mlp", args, policy="float32"),
        common.build_config("bf16", "mlp", args, policy="mixed_bfloat16"),
    ]
    timings = common.measure(configs, args)
    print(common.ratio(timings["float32"], timings["bf16"]))
"""

import argparse
import dataclasses
import gc
import os
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import report  # noqa: E402
import tensorflow as tf  # noqa: E402
from report import MODEL_NAMES  # noqa: E402

import kmp  # noqa: E402
from kmp.tools.bench import timing  # noqa: E402

# The sizes measured by default, and the tiny ones `--quick` uses to check
# that a script runs at all. `batch` is the batch size of a training step.
FULL_SIZES = {
    "mlp": {"inputs": 784, "units": 4096, "batch": 256},
    "many_small": {"inputs": 32, "layers": 100, "units": 32, "batch": 64},
    "cnn": {"image": 64, "filters": 64, "batch": 32},
    "transformer": {
        "length": 128,
        "width": 256,
        "heads": 4,
        "hidden": 1024,
        "vocabulary": 1000,
        "batch": 32,
    },
    "lstm": {"length": 64, "features": 32, "units": 256, "batch": 64},
}
QUICK_SIZES = {
    "mlp": {"inputs": 784, "units": 64, "batch": 16},
    "many_small": {"inputs": 32, "layers": 4, "units": 32, "batch": 16},
    "cnn": {"image": 16, "filters": 8, "batch": 4},
    "transformer": {
        "length": 16,
        "width": 32,
        "heads": 2,
        "hidden": 64,
        "vocabulary": 100,
        "batch": 4,
    },
    "lstm": {"length": 8, "features": 8, "units": 16, "batch": 4},
}
CLASSES = 10


OPTIMIZERS = ("adam", "fused-adam")

# --- Command line -------------------------------------------------------------


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the options every benchmark shares (sizes, rounds, warm-up)."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and few steps: checks that the script runs; the "
        "numbers mean nothing",
    )
    parser.add_argument(
        "--units",
        type=int,
        default=None,
        help="width of the MLP's two hidden layers (default 4096)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size for every model (default: per model, see README)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timing rounds (default 15)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per configuration per round (default 10)",
    )
    parser.add_argument(
        "--warmup-min",
        type=int,
        default=None,
        help="at least this many warm-up steps after tracing (default 30)",
    )
    parser.add_argument(
        "--warmup-max",
        type=int,
        default=None,
        help="at most this many warm-up steps (default 300)",
    )
    parser.add_argument(
        "--jit",
        action="store_true",
        help="compile steps with XLA (fit: jit_compile=True; loops: "
        "tf.function(jit_compile=True)); off by default, as Keras does on "
        "CPU-only machines",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="TensorFlow intra-op threads (default: TensorFlow's choice)",
    )
    parser.add_argument(
        "--no-remapping",
        action="store_true",
        help="turn off Grappler's op fusion ('remapping'): on CPUs its fused "
        "float16 MatMul+BiasAdd kernel is about 1000x slower than the "
        "unfused ops, which makes mixed_float16 steps unmeasurably slow",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="the inner optimizer: Keras 3's Adam, or kmp.FusedAdam (the "
        "same update in one TensorFlow kernel per variable) (default adam)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")


def parse_args(
    parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None
) -> argparse.Namespace:
    """Parses the command line and fills in the defaults `--quick` changes.

    Also applies `--threads`, which must happen before TensorFlow runs
    anything.
    """
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "rounds": 2 if quick else 15,
        "steps": 2 if quick else 10,
        "warmup_min": 2 if quick else 30,
        "warmup_max": 3 if quick else 300,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("rounds", "steps", "warmup_min", "warmup_max"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup_max < args.warmup_min:
        parser.error("--warmup-max must be at least --warmup-min")
    if args.threads is not None:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    if args.no_remapping:
        tf.config.optimizer.set_experimental_options({"remapping": False})
    return args


def model_sizes(name: str, args: argparse.Namespace) -> Dict[str, int]:
    """The sizes of model `name` under `--quick`, `--units` and `--batch`."""
    sizes = dict((QUICK_SIZES if args.quick else FULL_SIZES)[name])
    if name == "mlp" and args.units is not None:
        sizes["units"] = args.units
    if args.batch is not None:
        sizes["batch"] = args.batch
    return sizes


# --- Models and data ----------------------------------------------------------


def build_model(name: str, sizes: Dict[str, int], k: Any = keras):
    """Builds model `name` with the layers of the Keras module `k`.

    The model follows the global policy, except its last layer, which is
    float32 (the usual mixed-precision set-up: float32 logits and loss).
    `k` is `keras` (Keras 3), or `tf_keras` for a Keras 2 comparison.
    """
    layers = k.layers
    logits = layers.Dense(CLASSES, dtype="float32", name="logits")
    if name == "mlp":
        return k.Sequential(
            [
                k.Input((sizes["inputs"],)),
                layers.Dense(sizes["units"], activation="relu"),
                layers.Dense(sizes["units"], activation="relu"),
                logits,
            ],
            name="mlp",
        )
    if name == "many_small":
        hidden = [
            layers.Dense(sizes["units"], activation="relu")
            for _ in range(sizes["layers"])
        ]
        return k.Sequential(
            [k.Input((sizes["inputs"],)), *hidden, logits], name="many_small"
        )
    if name == "cnn":
        filters = sizes["filters"]
        image = sizes["image"]

        def conv(width):
            return layers.Conv2D(width, 3, padding="same", activation="relu")

        return k.Sequential(
            [
                k.Input((image, image, 3)),
                conv(filters),
                conv(filters),
                layers.MaxPooling2D(),
                conv(2 * filters),
                conv(2 * filters),
                layers.GlobalAveragePooling2D(),
                logits,
            ],
            name="cnn",
        )
    if name == "transformer":
        width = sizes["width"]
        tokens = k.Input((sizes["length"],), dtype="int32")
        x = layers.Embedding(sizes["vocabulary"], width)(tokens)
        attention = layers.MultiHeadAttention(
            sizes["heads"], width // sizes["heads"]
        )(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, attention]))
        hidden = layers.Dense(sizes["hidden"], activation="relu")(x)
        x = layers.LayerNormalization()(
            layers.Add()([x, layers.Dense(width)(hidden)])
        )
        x = layers.GlobalAveragePooling1D()(x)
        return k.Model(tokens, logits(x), name="transformer")
    if name == "lstm":
        return k.Sequential(
            [
                k.Input((sizes["length"], sizes["features"])),
                layers.LSTM(sizes["units"]),
                logits,
            ],
            name="lstm",
        )
    raise ValueError(
        f"'name' must be one of {', '.join(MODEL_NAMES)}. Received: {name!r}"
    )


def make_data(name: str, sizes: Dict[str, int], seed: int = 0):
    """One generated batch `(x, y)` of NumPy arrays for model `name`.

    Labels are integers in [0, 10); inputs are standard normal floats, or
    token ids for the transformer.
    """
    rng = np.random.default_rng(seed)
    batch = sizes["batch"]
    if name in ("mlp", "many_small"):
        shape = (batch, sizes["inputs"])
    elif name == "cnn":
        shape = (batch, sizes["image"], sizes["image"], 3)
    elif name == "lstm":
        shape = (batch, sizes["length"], sizes["features"])
    elif name == "transformer":
        shape = None
    else:
        raise ValueError(
            f"'name' must be one of {', '.join(MODEL_NAMES)}. "
            f"Received: {name!r}"
        )
    if shape is None:
        x = rng.integers(0, sizes["vocabulary"], (batch, sizes["length"]))
        x = x.astype("int32")
    else:
        x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, CLASSES, (batch,)).astype("int32")
    return x, y


def weight_bytes(model) -> int:
    """Bytes held by the model's variables."""
    return sum(int(v.numpy().nbytes) for v in model.variables)


# --- Training steps -----------------------------------------------------------


def make_loop_step(model, optimizer, x, y, protocol: str, jit: bool = False):
    """A custom-loop training step on the batch `(x, y)`, as a callable.

    Args:
        model: A Keras model with float32 logits.
        optimizer: A plain Keras optimizer for `"plain"`, a
            `kmp.LossScaleOptimizer` for `"kmp"`, a Keras
            `LossScaleOptimizer` for `"keras"`.
        x, y: The batch; the same tensors are used by every step.
        protocol: `"plain"` (gradients of the loss), `"kmp"`
            (`get_scaled_loss` / `get_unscaled_gradients` /
            `apply_gradients`) or `"keras"` (`scale_loss` /
            `apply_gradients`, which unscales).
        jit: Whether the step is compiled with XLA.

    Returns:
        A function with no arguments that runs one step (one `tf.function`
        call) and returns the loss tensor. Its `.step` attribute is the
        `tf.function`.
    """
    if protocol not in ("plain", "kmp", "keras"):
        raise ValueError(
            "'protocol' must be 'plain', 'kmp' or 'keras'. Received: "
            f"protocol={protocol!r}"
        )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    # Built before tracing, so the step reads the optimizers' variables (the
    # loss scale included) rather than their initial values.
    optimizer.build(variables)

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if protocol == "kmp":
                target = optimizer.get_scaled_loss(loss)
            elif protocol == "keras":
                target = optimizer.scale_loss(loss)
            else:
                target = loss
        grads = tape.gradient(target, variables)
        if protocol == "kmp":
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    x = tf.constant(x)
    y = tf.constant(y)

    def run():
        return step(x, y)

    run.step = step
    return run


def make_fit_step(model, x, y):
    """One call of the train function `model.fit` runs for every batch.

    `model` must be compiled. The function is the one `fit` builds
    (`model.make_train_function()`), fed from a distributed `tf.data`
    iterator that repeats `(x, y)`, as `fit` feeds it; only `fit`'s
    callbacks and progress bar are left out.

    Returns:
        A function with no arguments that runs one step and returns the
        `"loss"` entry of the logs (a tensor).
    """
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    dataset = model.distribute_strategy.experimental_distribute_dataset(dataset)
    iterator = iter(dataset)
    model.make_train_function()
    train_function = model.train_function

    def run():
        return train_function(iterator)["loss"]

    return run


@dataclasses.dataclass
class Config:
    """One configuration to time: a label and its training step.

    Attributes:
        label: The name shown in tables.
        step: Runs one training step and returns the loss (a tensor).
        model: The model trained.
        optimizer: Its optimizer; `optimizer.iterations` counts applied steps
            (a loss-scale optimizer skips steps with inf/NaN gradients).
            None when the step applies no update.
        details: Free text printed with the configuration.
    """

    label: str
    step: Callable[[], Any]
    model: Any
    optimizer: Any
    details: str = ""


def build_config(
    label: str,
    model_name: str,
    args: argparse.Namespace,
    policy: str = "float32",
    path: str = "loop",
    loss_scale: Optional[str] = None,
) -> Config:
    """Builds a model under `policy` with Adam and one of its training steps.

    The Adam is Keras 3's, or `kmp.FusedAdam` under `--optimizer fused-adam`.

    Args:
        label: The configuration's name in tables.
        model_name: One of `MODEL_NAMES`.
        args: The parsed command line (sizes, `--jit`, `--seed`).
        policy: The global policy the model is built under (set with
            `kmp.policy_scope`).
        path: `"loop"` (a custom training loop) or `"fit"` (the train
            function `fit` calls).
        loss_scale: `None` (plain Adam), `"kmp"` (`kmp.LossScaleOptimizer`)
            or `"keras"` (`keras.optimizers.LossScaleOptimizer`).

    Returns:
        A `Config`.
    """
    sizes = model_sizes(model_name, args)
    x, y = make_data(model_name, sizes, seed=args.seed)
    keras.utils.set_random_seed(args.seed)
    with kmp.policy_scope(policy):
        model = build_model(model_name, sizes)
    if args.optimizer == "fused-adam":
        optimizer = kmp.FusedAdam(1e-4)
    else:
        optimizer = keras.optimizers.Adam(1e-4)
    if loss_scale == "kmp":
        optimizer = kmp.LossScaleOptimizer(optimizer)
    elif loss_scale == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    elif loss_scale is not None:
        raise ValueError(
            "'loss_scale' must be None, 'kmp' or 'keras'. Received: "
            f"loss_scale={loss_scale!r}"
        )
    if path == "loop":
        step = make_loop_step(
            model, optimizer, x, y, loss_scale or "plain", jit=args.jit
        )
    elif path == "fit":
        # auto_scale_loss=False: the optimizer is exactly the one given, so
        # the plain configuration is plain even under mixed_float16.
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=args.jit,
            auto_scale_loss=False,
        )
        step = make_fit_step(model, x, y)
    else:
        raise ValueError(
            f"'path' must be 'loop' or 'fit'. Received: path={path!r}"
        )
    details = (
        f"{model_name} {policy} {path} "
        f"{type(optimizer).__module__.split('.')[0]}."
        f"{type(optimizer).__name__} "
        f"batch={sizes['batch']} variables={len(model.trainable_variables)} "
        f"params={model.count_params():,}"
    )
    return Config(label, step, model, optimizer, details)


# --- Timing -------------------------------------------------------------------

# The toolkit `kmp bench` uses too (see kmp/tools/bench/timing.py).
Timing = timing.Timing
Ratio = timing.Ratio
ratio = timing.ratio


def warm_up(step, minimum: int, maximum: int, window: int = 5):
    """Traces `step` and runs it until its step time settles.

    `kmp.tools.bench.timing.warm_up`: after the first call, at least `minimum`
    and at most `maximum` steps, until the median of the last `window` is
    within 10% of the `window` before (steps right after tracing can be
    many times slower than later ones, see README.md).

    Returns:
        `(trace_seconds, warmup_steps, median of the last window)`.
    """
    return timing.warm_up(step, minimum, maximum, window)


def measure(configs: Sequence[Config], args) -> Dict[str, Timing]:
    """Warms every configuration up, then times them interleaved.

    `kmp.tools.bench.timing.measure` with the command line's settings: in round
    `r` the configurations run in the order rotated by `r`; each runs one
    untimed step and then `args.steps` timed steps. Also counts the steps
    each configuration's optimizer skipped (`Timing.skipped`).

    Returns:
        `{label: Timing}` in the order of `configs`.
    """

    def log(line):
        print(line, flush=True)

    applied_before = {}

    def warmed_up(config, _):
        if config.optimizer is not None:
            applied_before[config.label] = _applied(config)

    timings = timing.measure(
        configs,
        rounds=args.rounds,
        steps=args.steps,
        warmup_min=args.warmup_min,
        warmup_max=args.warmup_max,
        warmed_up=warmed_up,
        log=log,
    )
    steps_run = args.rounds * (args.steps + 1)  # With each round's untimed.
    for config in configs:
        if config.optimizer is not None:
            applied = _applied(config) - applied_before[config.label]
            timings[config.label].skipped = steps_run - applied
    return timings


def _applied(config) -> int:
    return int(config.optimizer.iterations.numpy())


# --- Printing -----------------------------------------------------------------

print_table = report.print_table


def print_machine(title: str, args: argparse.Namespace) -> None:
    """Prints the benchmark's title, the machine and the timing settings."""
    threads = tf.config.threading.get_intra_op_parallelism_threads()
    report.print_machine(title, threads=threads or None)
    print(
        f"{'timing':>16}: {args.rounds} rounds x {args.steps} steps per "
        f"configuration, warm-up {args.warmup_min}-{args.warmup_max} steps, "
        f"jit={'on' if args.jit else 'off'}"
    )
    if args.quick:
        print(
            f"{'':>16}  --quick: tiny sizes, to check the script runs; the "
            "numbers below mean nothing"
        )
    print(flush=True)


def timing_rows(timings: Dict[str, Timing]) -> List[List[str]]:
    """Rows for `print_table(TIMING_HEADERS, ...)`: one per configuration."""
    rows = []
    for measured in timings.values():
        low, q1, median, q3, high = (t * 1e3 for t in measured.quantiles())
        rows.append(
            [
                measured.label,
                f"{median:.3f}",
                f"{q1:.3f}-{q3:.3f}",
                f"{low:.3f}-{high:.3f}",
                str(len(measured.times)),
                f"{measured.trace_seconds:.2f}",
                str(measured.warmup_steps),
                "-" if measured.skipped is None else str(measured.skipped),
            ]
        )
    return rows


TIMING_HEADERS = (
    "config",
    "median ms",
    "IQR ms",
    "min-max ms",
    "steps",
    "1st call s",
    "warm-up",
    "skipped",
)


def release(configs: Sequence[Config]) -> None:
    """Drops the configurations' models and Keras's global state."""
    for config in configs:
        config.step = config.model = config.optimizer = None
    keras.backend.clear_session()
    gc.collect()
