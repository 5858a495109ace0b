"""`kmp bench`: time and compare policies on a small classifier.

The benchmark itself is `kmp.tools.bench`; this module is its command line.
`--backend` runs it on a given Keras backend: in a fresh process with
`KERAS_BACKEND` set when that is not the backend of this one. For now the
benchmark runs on TensorFlow only (see `UNSUPPORTED`).
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import time

from kmp_cli import arguments

LOOPS = ("fit", "custom")
BACKENDS = ("tensorflow", "jax", "torch")
# The defaults of kmp.tools.bench.run_benchmark (a test keeps them equal),
# here so that `kmp bench --help` imports no kmp.
DEFAULT_POLICIES = "float32,mixed_bfloat16,mixed_float16"
DEFAULT_STEPS = 400
DEFAULT_BATCH_SIZE = 256
DEFAULT_UNITS = 2048
DEFAULT_ROUNDS = 5
DEFAULT_WARMUP_STEPS = 10
# Why the benchmark does not run on the other backends yet.
UNSUPPORTED = (
    "the benchmark is written for TensorFlow: its custom loop is a "
    "tf.function around a tf.GradientTape, its fit rows feed the train "
    "function from a tf.data iterator, and its float16 rows switch off "
    "TensorFlow's op fusion (tf.config.optimizer)"
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `kmp bench` and its options on the `kmp` command line."""
    parser = subparsers.add_parser(
        "bench",
        help="time and compare policies on a small classifier",
        description=(
            "Train the same classifier on scikit-learn's digits under each "
            "policy, with model.fit's train step and a custom GradientTape "
            "loop, and compare step time, loss, accuracy and loss scaling. "
            "Steps are timed one by one, after warm-up, in interleaved "
            "rounds; the table shows medians with the interquartile range. "
            "The defaults take one to two minutes on a 2-core CPU."
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
            "untimed steps per configuration after its first call",
        ),
    ):
        parser.add_argument(
            flag,
            type=arguments.positive_int,
            default=default,
            metavar="N",
            help=f"{text} (default: %(default)s)",
        )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="the Keras backend to run on (default: the current one, from "
        "KERAS_BACKEND); only tensorflow is supported yet",
    )
    parser.add_argument(
        "--no-native",
        dest="native",
        action="store_false",
        help="skip the comparison with Keras 3's own LossScaleOptimizer",
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


def _run_elsewhere(args) -> int:
    """Runs this same command in a new process on `args.backend`."""
    environment = dict(os.environ, KERAS_BACKEND=args.backend)
    command = "import sys, kmp_cli; sys.exit(kmp_cli.main(sys.argv[1:]))"
    return subprocess.call(
        [sys.executable, "-c", command, *args.argv], env=environment
    )


def run(args: argparse.Namespace) -> int:
    """Runs `kmp bench` with parsed arguments; prints tables and summary."""
    parser = args.bench_parser
    if args.rounds > args.steps:
        parser.error(
            f"argument --rounds: must be at most --steps ({args.steps}), "
            f"got {args.rounds}"
        )
    if args.backend not in (None, "tensorflow"):
        parser.error(
            f"argument --backend: {args.backend} is not supported yet: "
            f"{UNSUPPORTED}. Use --backend tensorflow."
        )
    if args.backend and os.environ.get("KERAS_BACKEND") != args.backend:
        return _run_elsewhere(args)
    if importlib.util.find_spec("sklearn") is None:
        print(
            "kmp bench needs scikit-learn for its data set: "
            "pip install 'kmp[bench]'",
            file=sys.stderr,
        )
        return 1
    import keras

    if keras.backend.backend() != "tensorflow":
        parser.error(
            f"Keras runs on {keras.backend.backend()!r} here, which kmp "
            f"bench does not support yet: {UNSUPPORTED}. Use --backend "
            "tensorflow."
        )
    from kmp.core.policy import POLICY_NAMES

    try:
        arguments.check_names(args.policies, POLICY_NAMES, "policy")
    except argparse.ArgumentTypeError as error:
        parser.error(f"argument --policies: {error}")
    from kmp.tools import bench
    from kmp.tools import bench_report

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
    )
    wall_seconds = time.perf_counter() - started
    print()
    print(bench_report.format_table(results))
    print()
    print(bench_report.summarize(results))
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
        bench_report.write_json(results, args.json, settings)
        print(f"Wrote {args.json}")
    if args.plot:
        bench_report.write_plot(results, args.plot)
        print(f"Wrote {args.plot}")
    return 0


__all__ = ["add_parser", "run"]
