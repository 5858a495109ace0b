"""`kmp bench`: time and compare policies on one model, on any backend.

The benchmark itself is `kmp.tools.bench`; this module is its command line.
It runs on the Keras backend `--backend` names, else on the one Keras runs
on or would pick (`choose_backend`), in a fresh process with
`KERAS_BACKEND` set when this process already runs Keras on another.
A backend that is not installed ends the command with one line saying
what to install.
"""

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

from kmp_cli import arguments

LOOPS = ("fit", "custom")
BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("digits", "mlp", "cnn", "transformer")
SIZES = ("auto", "large", "small", "tiny")
# The defaults of kmp.tools.bench.run_benchmark (a test keeps them equal),
# here so that `kmp bench --help` imports no kmp.
DEFAULT_POLICIES = "float32,mixed_bfloat16,mixed_float16"
DEFAULT_MODEL = "digits"
DEFAULT_SIZE = "auto"
DEFAULT_BUDGET_SECONDS = 90.0
DEFAULT_ROUNDS = 5
DEFAULT_WARMUP_STEPS = 10
# kmp.tools.bench.stats's minimum: never fewer timed steps per round, and
# never fewer rounds (a test keeps them equal).
MIN_ROUNDS = 5
MIN_ROUND_STEPS = 20
# What to install for each backend (the module that must import).
_INSTALL = {
    "tensorflow": ("tensorflow", "pip install 'kmp[cpu]' (or 'kmp[gpu]')"),
    "jax": ("jax", "pip install 'kmp[jax]'"),
    "torch": ("torch", "pip install 'kmp[torch]'"),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `kmp bench` and its options on the `kmp` command line."""
    parser = subparsers.add_parser(
        "bench",
        help="time and compare policies on one model, on any backend",
        description=(
            "Train the same model under each policy, with model.fit's "
            "train step and the backend's custom loop (TensorFlow: a "
            "GradientTape loop; JAX: the jitted stateless loop; torch: the "
            "backward() loop, and plain PyTorch AMP beside it), and compare "
            "step time, loss, accuracy and loss scaling. Building, "
            "compiling and warming up come first, untimed, reported on a "
            "line of their own. Then the steps run in interleaved rounds "
            "(at least 5 rounds of 20 steps per configuration), timed in "
            "blocks with one device sync per block; the table shows median "
            "step times with the interquartile range, and every ratio with "
            "a 95%% bootstrap interval, marked ! when wider than 10%%. "
            "Unless --steps fixes them, the timed steps fill about "
            "--budget seconds (never fewer than the minimum: the run then "
            "says so and takes longer)."
        ),
    )
    parser.add_argument(
        "--policies",
        # Checked against kmp's policies in run(): importing kmp here would
        # import Keras on this process's backend, maybe not --backend.
        type=arguments.names_among(None, "policy"),
        default=DEFAULT_POLICIES,
        metavar="P1,P2",
        help="comma-separated kmp policy names (default: %(default)s)",
    )
    parser.add_argument(
        "--loops",
        type=arguments.names_among(LOOPS, "loop"),
        default=",".join(LOOPS),
        metavar="fit,custom",
        help="training loops to run (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default=DEFAULT_MODEL,
        help="the model: the digits classifier, or one sized for a GPU "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        choices=SIZES,
        default=DEFAULT_SIZE,
        help="the model's size: large (for a GPU), small (a CPU), tiny "
        "(tests); auto: large with a GPU (default: %(default)s)",
    )
    parser.add_argument(
        "--budget",
        type=positive_seconds,
        default=DEFAULT_BUDGET_SECONDS,
        metavar="SECONDS",
        help="about how long the timed steps and the evaluation take, "
        "when --steps is not given; building, compiling and warming up "
        "come on top (default: %(default)g)",
    )
    for flag, default, text in (
        ("--steps", None, "timed steps per configuration, at least 20 per "
         "round (default: as many as fit in --budget)"),
        ("--batch-size", None, "examples per step (default: the model's)"),
        ("--units", None, "the model's width: hidden units, filters or "
         "model width (default: the model's)"),
        ("--rounds", DEFAULT_ROUNDS, "interleaved rounds the steps are "
         "split into, at least 5 (default: %(default)s)"),
        ("--warmup", DEFAULT_WARMUP_STEPS, "untimed steps per configuration "
         "after its first call (the most, without --steps) (default: "
         "%(default)s)"),
    ):  # fmt: skip
        parser.add_argument(
            flag,
            type=arguments.positive_int,
            default=default,
            metavar="N",
            help=text,
        )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="the Keras backend to run on (default: KERAS_BACKEND, else "
        "Keras's configured one, else the first installed)",
    )
    parser.add_argument(
        "--no-native",
        dest="native",
        action="store_false",
        help="skip the comparison with Keras 3's own LossScaleOptimizer",
    )
    parser.add_argument(
        "--no-torch-amp",
        dest="torch_amp",
        action="store_false",
        help="on torch, skip plain PyTorch AMP (torch.autocast and "
        "torch.amp.GradScaler)",
    )
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="also run the float16 policies without loss scaling, to show "
        "what loss scaling costs",
    )
    parser.add_argument(
        "--low-precision",
        action="store_true",
        help="also train bfloat16 weights with kmp.LowPrecisionOptimizer, "
        "with 16-bit and with 8-bit optimizer state",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="measure each configuration's peak device memory (GPUs; JAX "
        "also on a CPU)",
    )
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR",
        default=None,
        help="on JAX, keep compiled steps in this folder between runs, or "
        "'none' (default: $KMP_JAX_CACHE_DIR, else ~/.cache/kmp/jax)",
    )
    parser.add_argument(
        "--json",
        type=arguments.writable_path(),
        metavar="FILE",
        help="also write every measurement and machine information as JSON",
    )
    parser.add_argument(
        "--plot",
        type=arguments.plot_path,
        metavar="FILE.png",
        help="also plot loss curves and loss-scale trajectories (matplotlib)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="only the results, no progress"
    )
    parser.set_defaults(func=run, bench_parser=parser)
    return parser


def positive_seconds(text: str) -> float:
    """`text` as a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds > 0, got {text!r}"
        )
    return value


def _configured_backend():
    """The backend `keras.json` names (Keras writes it at its first run)."""
    directory = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras"
    )
    try:
        with open(os.path.join(directory, "keras.json")) as file:
            return json.load(file).get("backend")
    except (OSError, ValueError, AttributeError):
        return None


def _installed(backend) -> bool:
    return importlib.util.find_spec(_INSTALL[backend][0]) is not None


def choose_backend(requested=None):
    """The backend `kmp bench` runs on: `requested`, else the one Keras
    already runs on in this process, else KERAS_BACKEND, else the one
    `keras.json` names if it is installed, else the first installed of
    TensorFlow, JAX and torch (None if none is)."""
    if requested:
        return requested
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    configured = _configured_backend()
    if configured in BACKENDS and _installed(configured):
        return configured
    return next((b for b in BACKENDS if _installed(b)), None)


def _run_elsewhere(args, backend) -> int:
    """Runs this same command in a new process on `backend`."""
    environment = dict(os.environ, KERAS_BACKEND=backend)
    command = "import sys, kmp_cli; sys.exit(kmp_cli.main(sys.argv[1:]))"
    return subprocess.call(
        [sys.executable, "-c", command, *args.argv], env=environment
    )


def _cache(value):
    """--compilation-cache as `run_benchmark` takes it."""
    if value is None:
        return True
    return False if value.lower() == "none" else value


def _missing(text) -> int:
    print(f"kmp bench: {text}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    """Runs `kmp bench` with parsed arguments; prints tables and summary."""
    parser = args.bench_parser
    if args.rounds < MIN_ROUNDS:
        parser.error(
            f"argument --rounds: must be at least {MIN_ROUNDS}, got "
            f"{args.rounds}: fewer rounds put no interval on a ratio"
        )
    fewest = MIN_ROUND_STEPS * args.rounds
    if args.steps is not None and args.steps < fewest:
        parser.error(
            f"argument --steps: must be at least {fewest} ({args.rounds} "
            f"rounds of {MIN_ROUND_STEPS}), got {args.steps}: kmp bench "
            "prints no median of fewer steps"
        )
    backend = choose_backend(args.backend)
    if backend is None:
        return _missing(
            "no Keras backend is installed: pip install 'kmp[cpu]', "
            "'kmp[jax]' or 'kmp[torch]'"
        )
    if not _installed(backend):
        module, install = _INSTALL[backend]
        return _missing(
            f"the {backend} backend needs {module}, which is not installed "
            f"here: {install}"
        )
    if "keras" in sys.modules:
        if sys.modules["keras"].backend.backend() != backend:
            return _run_elsewhere(args, backend)
    else:
        os.environ["KERAS_BACKEND"] = backend
    if args.model == "digits" and importlib.util.find_spec("sklearn") is None:
        return _missing(
            "the digits model needs scikit-learn for its data set: "
            "pip install 'kmp[bench]' (or pick --model mlp, cnn or "
            "transformer)"
        )
    from kmp.core.policy import POLICY_NAMES

    try:
        arguments.check_names(args.policies, POLICY_NAMES, "policy")
    except argparse.ArgumentTypeError as error:
        parser.error(f"argument --policies: {error}")
    from kmp.tools import bench
    from kmp.tools.bench import report as bench_report

    problem = bench.unsupported(args.model, args.policies)
    if problem:
        parser.error(f"argument --policies: {problem}")

    started = time.perf_counter()
    results = bench.run_benchmark(
        policies=args.policies,
        loops=args.loops,
        steps=args.steps,
        batch_size=args.batch_size,
        units=args.units,
        rounds=args.rounds,
        native=args.native,
        warmup_steps=args.warmup,
        verbose=not args.quiet,
        model=args.model,
        size=args.size,
        budget_seconds=args.budget,
        overhead=args.overhead,
        torch_amp=args.torch_amp,
        memory=args.memory,
        compilation_cache=_cache(args.compilation_cache),
        low_precision=args.low_precision,
    )
    wall_seconds = time.perf_counter() - started
    print()
    print(bench_report.format_table(results))
    print()
    print(bench_report.summarize(results))
    print(f"\nWall time: {wall_seconds:.0f} s.")
    if args.json:
        settings = {
            "backend": backend,
            "model": args.model,
            "size": results[0]["size"],
            "policies": list(args.policies),
            "loops": list(args.loops),
            "steps": results[0]["steps"],
            "steps_fixed": args.steps is not None,
            "budget_seconds": args.budget,
            "batch_size": results[0]["batch_size"],
            "units": results[0]["units"],
            "rounds": results[0]["rounds"],
            "blocks_per_round": results[0]["blocks_per_round"],
            "compile_and_warmup_seconds": sum(
                r["build_seconds"]
                + r["first_call_seconds"]
                + r["warmup_seconds"]
                for r in results
            ),
            "warmup_steps": args.warmup,
            "native": args.native,
            "overhead": args.overhead,
            "low_precision": args.low_precision,
            "torch_amp": args.torch_amp,
            "wall_seconds": wall_seconds,
        }
        command = shlex.join(["kmp", *args.argv])
        bench_report.write_json(results, args.json, settings, command)
        print(f"Wrote {args.json}")
    if args.plot:
        bench_report.write_plot(results, args.plot)
        print(f"Wrote {args.plot}")
    return 0


__all__ = ["add_parser", "choose_backend", "run"]
