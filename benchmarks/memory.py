"""Peak training memory beyond the weights: mixed_bfloat16 against float32.

Each configuration (model x policy) runs in a fresh subprocess, which

1. builds the model under the policy, builds Adam on its variables, makes one
   generated batch, and traces the training step (without running it);
2. resets the kernel's peak-RSS mark (`/proc/self/clear_refs`) and reads the
   resident set size: the *baseline* (weights, optimizer slots, the batch, the
   traced graph, TensorFlow itself);
3. trains a few steps and reads the peak RSS (`VmHWM` in `/proc/self/status`).

*Beyond* = peak - baseline: activations, gradients, the low-precision copies
of the weights and every temporary buffer of a training step. The script
prints it for both policies and their ratio, mixed_bfloat16 / float32, next to
the goal (at most 0.55x). Defaults: the CNN (64x64x3 images, batch 64) and the
MLP (784-4096-4096-10) at batch 8192.

    python benchmarks/memory.py                    # the real measurement
    python benchmarks/memory.py --batch 4096       # another batch size
    python benchmarks/memory.py --tf-keras         # also Keras 2 (tf_keras)
    python benchmarks/memory.py --quick            # checks that it runs

`--results` writes `benchmarks/results/memory.json`, the performance page's
table.
"""

import argparse
import concurrent.futures
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import report

GOAL = 0.55
POLICIES = ("float32", "mixed_bfloat16")
MEMORY_BATCH = {"mlp": 8192, "cnn": 64}
QUICK_BATCH = {"mlp": 64, "cnn": 4}
MEGABYTE = 1024 * 1024
RESULTS = "memory.json"
SERIES = {"keras": "through kmp", "tf_keras": "tf_keras"}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                value, unit = line.split(":", 1)[1].split()
                assert unit == "kB", line
                return int(value) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux 4.0+); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _child(args) -> int:
    """Measures one configuration and prints it as one JSON line."""
    import common  # Imports TensorFlow: only children pay for it twice.
    from common import tf

    if args.framework == "tf_keras":
        import tf_keras as k

        k.mixed_precision.set_global_policy(args.policy)
    else:
        import keras as k

        import kmp

        kmp.set_global_policy(args.policy)
    sizes = common.model_sizes(args.model, args)
    x, y = common.make_data(args.model, sizes, seed=args.seed)
    x, y = tf.constant(x), tf.constant(y)
    k.utils.set_random_seed(args.seed)
    model = common.build_model(args.model, sizes, k)
    optimizer = k.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)
    loss_fn = k.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step.get_concrete_function(x, y)
    reset = _reset_peak()
    baseline = _status_bytes("VmRSS")
    start_peak = _status_bytes("VmHWM")
    for _ in range(args.train_steps):
        loss = float(step(x, y).numpy())
    peak = _status_bytes("VmHWM")
    result = {
        "baseline": baseline,
        "peak": peak,
        "peak_reset": reset,
        "start_peak": start_peak,
        "weights": common.weight_bytes(model),
        "optimizer": sum(int(v.numpy().nbytes) for v in optimizer.variables),
        "batch": sizes["batch"],
        "loss": loss,
        "compute_dtype": str(model.layers[1].compute_dtype),
    }
    print(json.dumps(result), flush=True)
    return 0


def _child_command(args, model, framework, policy):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--model",
        model,
        "--policy",
        policy,
        "--framework",
        framework,
        "--train-steps",
        str(args.train_steps),
        "--seed",
        str(args.seed),
        "--batch",
        str(args.batch or (QUICK_BATCH if args.quick else MEMORY_BATCH)[model]),
    ]
    if args.quick:
        command.append("--quick")
    if args.units is not None:
        command += ["--units", str(args.units)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    return command


def _run_child(args, model, framework, policy):
    completed = subprocess.run(
        _child_command(args, model, framework, policy),
        capture_output=True,
        text=True,
        check=False,
    )
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        sys.stderr.write(completed.stderr[-3000:])
        raise RuntimeError(
            f"measuring {model} {policy} {framework} failed with exit code "
            f"{completed.returncode}"
        )
    return json.loads(lines[-1])


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and batches: checks that the script runs",
    )
    report.add_models_argument(parser, "cnn,mlp")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size for every model (default: MLP 8192, CNN 64, "
        "others as in common.py)",
    )
    parser.add_argument(
        "--units",
        type=int,
        default=None,
        help="width of the MLP's hidden layers (default 4096)",
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="training steps per measurement (default 5)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="subprocesses per configuration; the median is kept (default 3)",
    )
    parser.add_argument(
        "--tf-keras",
        action="store_true",
        help="also measure the same models with tf_keras (Keras 2), if it is "
        "installed",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="subprocesses run at once (default 1; all with --quick). Each one "
        "measures its own peak, so this changes no number unless memory runs "
        "out",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    report.add_results_argument(parser, RESULTS)
    # Internal: run one measurement in this process.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--framework", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.train_steps is None:
        args.train_steps = 2 if args.quick else 5
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.train_steps < 1 or args.repeats < 1:
        parser.error("--train-steps and --repeats must be at least 1")
    results_file = report.results_path(parser, args, RESULTS)
    if args.child:
        if args.threads is not None:
            import tensorflow as tf

            tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        return _child(args)

    models = args.models
    frameworks = ["keras"]
    tf_keras_note = "not requested (--tf-keras)"
    if args.tf_keras:
        if importlib.util.find_spec("tf_keras") is None:
            tf_keras_note = (
                "requested but not installed (pip install tf_keras); skipped"
            )
        else:
            frameworks.append("tf_keras")
            tf_keras_note = "measured"
    keys = [
        (model, framework, policy)
        for _ in range(args.repeats)
        for model in models
        for framework in frameworks
        for policy in POLICIES
    ]
    if args.jobs is None:
        args.jobs = len(keys) if args.quick else 1
    elif args.jobs < 1:
        parser.error("--jobs must be at least 1")

    report.print_machine(
        "Peak training memory beyond the weights", threads=args.threads
    )
    print(
        f"{'measure':>16}: peak RSS (VmHWM) while training {args.train_steps} "
        f"steps minus RSS before; median over {args.repeats} subprocess(es) "
        f"per configuration, {args.jobs} at a time"
    )
    print(f"{'tf_keras run':>16}: {tf_keras_note}")
    if args.quick:
        print(f"{'':>16}  --quick: tiny sizes; the numbers mean nothing")
    print(flush=True)

    results = {key: [] for key in keys}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_run_child, args, *key): key for key in keys}
        for future in concurrent.futures.as_completed(futures):
            key = futures[future]
            try:
                measured = future.result()
            except Exception:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            results[key].append(measured)
            print(
                f"  {' '.join(key)}: beyond "
                f"{_beyond(measured) / MEGABYTE:.1f} MB",
                flush=True,
            )
    print()

    rows = []
    for (model, framework, policy), runs in results.items():
        beyond = statistics.median(_beyond(r) for r in runs)
        first = runs[0]
        rows.append(
            [
                model,
                framework,
                policy,
                first["compute_dtype"],
                str(first["batch"]),
                _mb(first["weights"]),
                _mb(first["optimizer"]),
                _mb(statistics.median(r["baseline"] for r in runs)),
                _mb(statistics.median(r["peak"] for r in runs)),
                _mb(beyond),
                "" if first["peak_reset"] else "peak not reset",
            ]
        )
    report.print_table(
        (
            "model",
            "framework",
            "policy",
            "compute",
            "batch",
            "weights MB",
            "opt MB",
            "baseline MB",
            "peak MB",
            "beyond MB",
            "note",
        ),
        rows,
    )

    print("== Summary: mixed_bfloat16 / float32, memory beyond the weights ==")
    rows, measurements, goals = [], [], {}
    for model in models:
        for framework in frameworks:
            bf16 = statistics.median(
                _beyond(r) for r in results[(model, framework, POLICIES[1])]
            )
            f32 = statistics.median(
                _beyond(r) for r in results[(model, framework, POLICIES[0])]
            )
            value = bf16 / f32 if f32 > 0 else float("nan")
            rows.append(
                [
                    model,
                    framework,
                    f"{value:.3f}x",
                    f"<= {GOAL}x",
                    "yes" if value <= GOAL else "NO",
                ]
            )
            batch = results[(model, framework, POLICIES[0])][0]["batch"]
            group = f"{model} (batch {batch})"
            goals[group] = {"op": "<=", "value": GOAL}
            measurements.append(
                {
                    "group": group,
                    "series": SERIES[framework],
                    "value": round(value, 2),
                    "run": f"{bf16 / MEGABYTE:.0f} / {f32 / MEGABYTE:.0f} MB",
                }
            )
    report.print_table(("model", "framework", "ratio", "goal", "met"), rows)
    report.write_results(
        results_file,
        script=report.script_path(__file__),
        title="Peak RSS beyond the baseline, mixed_bfloat16 / float32 "
        "(TensorFlow)",
        about="The process's peak resident size while training, beyond "
        "what it held before the first step (weights, optimizer slots, the "
        "batch, the traced step), under mixed_bfloat16 over float32's "
        "(0.5x = half the memory); each configuration in fresh "
        "subprocesses, the median of their peaks. The run column gives "
        "the two medians. Process memory as the OS sees it, allocator "
        "included: coarser than the allocator's peak of "
        "`memory_breakdown.py`.",
        tables=[
            {
                "caption": "Peak RSS beyond the baseline, mixed_bfloat16 / "
                "float32",
                "unit": "x",
                "decimals": 2,
                "better": "lower",
                "goals": goals,
                "measurements": measurements,
            }
        ],
    )
    return 0


def _beyond(result) -> int:
    return result["peak"] - result["baseline"]


def _mb(value) -> str:
    return f"{value / MEGABYTE:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
