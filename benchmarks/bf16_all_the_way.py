"""bfloat16 all the way: accuracy and training memory with bfloat16 weights.

Trains the same models from the same initial weights, on the same batches in
the same order, under each configuration:

* `float32`: float32 weights and Adam;
* `mixed_bfloat16`: bfloat16 compute, float32 weights and slots (kmp's
  mixed precision);
* `mixed+bf16-slots`: the same with Adam's moments in bfloat16
  (`kmp.LowPrecisionOptimizer(Adam, rounding="nearest", slot_dtype=...)`);
* `bfloat16`: pure bfloat16 weights and slots, Keras's Adam as it is;
* `bf16+nearest`: pure bfloat16, Adam's update in float32 then rounded to
  nearest (`kmp.LowPrecisionOptimizer(Adam, rounding="nearest")`);
* `bf16+kahan`: pure bfloat16 with Kahan compensation;
* `bf16+stochastic`: pure bfloat16 with stochastic rounding.

Tasks:

* `digits`: scikit-learn's bundled 8x8 digits, an MLP 64-256-256-10, Adam
  with cosine decay (1e-3 to 0), batch 32; test accuracy on 397 held-out
  images.
* `sort`: a generated task, sorting 12 digits: a 2-block Transformer encoder
  (width 64, 4 heads), one output per position, Adam with cosine decay;
  token and sequence accuracy on 2000 new sequences.
* `memory`: the MLP 784-4096-4096-10 (20M parameters) with Adam at batch
  8192, each configuration in its own subprocess: bytes of weights and of
  optimizer state, and the allocator's peak per step beyond what was
  allocated before the first step (median of `--memory-steps`); total = the
  three added. The peak is TensorFlow's allocator statistics, JAX's device
  memory statistics or torch's CUDA ones; where the backend keeps none (JAX
  and torch on a CPU, TensorFlow on CPUs without them) it says "not
  measurable on this machine" and the memory goal is not judged.

Every configuration trains with Keras's own training step
(`model.train_on_batch`), so it runs on whichever backend Keras uses
(`KERAS_BACKEND`: TensorFlow by default, JAX, torch). The last layer
computes in the policy's dtype; a float32 linear activation hands float32
logits to the loss. It prints the tables, the goals (accuracy within 0.5
point of float32's; training memory at most 0.45x float32's) and whether
they are met, and writes the loss curves to `--plot`. `--results` writes
the performance page's file: `benchmarks/results/bf16_all_the_way.json` on
TensorFlow, `bf16_all_the_way_backends.json` on JAX and torch.

    python benchmarks/bf16_all_the_way.py                     # ~15 min
    python benchmarks/bf16_all_the_way.py --tasks memory
    python benchmarks/bf16_all_the_way.py --quick             # checks it runs
    KERAS_BACKEND=jax python benchmarks/bf16_all_the_way.py --tasks digits
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import report

CONFIGS = (
    "float32",
    "mixed_bfloat16",
    "mixed+bf16-slots",
    "bfloat16",
    "bf16+nearest",
    "bf16+kahan",
    "bf16+stochastic",
)
TASKS = ("digits", "sort", "memory")
ACCURACY_GOAL = 0.5  # Points below float32, at most.
MEMORY_GOAL = 0.45  # Total training memory over float32's, at most.
MEGABYTE = 2**20
NOT_MEASURABLE = "not measurable on this machine"
RESULTS = {"tensorflow": "bf16_all_the_way.json"}
OTHER_BACKENDS_RESULTS = "bf16_all_the_way_backends.json"
BACKEND_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "torch"}
SERIES = {"bfloat16": "bfloat16 (Keras as is)"}


def _setup():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    import kmp

    return keras, kmp


def _policy_and_optimizer(keras, kmp, config, learning_rate, seed=0):
    """The global policy of `config` and a function making its optimizer."""
    policy = {"float32": "float32", "mixed_bfloat16": "mixed_bfloat16"}.get(
        config, "mixed_bfloat16" if config.startswith("mixed") else "bfloat16"
    )

    def make():
        adam = keras.optimizers.Adam(learning_rate())
        if config == "mixed+bf16-slots":
            return kmp.LowPrecisionOptimizer(
                adam, rounding="nearest", slot_dtype="bfloat16"
            )
        if config.startswith("bf16+"):
            rounding = config.split("+")[1]
            return kmp.LowPrecisionOptimizer(adam, rounding, seed=seed)
        return adam

    return policy, make


# --- Accuracy (one process, configurations one after the other) ---------------


def _digits(keras, np, quick):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = 1400

    def build():
        units = 32 if quick else 256
        return keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("linear", dtype="float32"),
            ]
        )

    def batches(steps):
        rows = np.random.default_rng(1).integers(0, split, (steps, 32))
        return [(x[r], y[r]) for r in rows]

    def score(model):
        predicted = np.argmax(model.predict(x[split:], verbose=0), -1)
        return {"accuracy": float(np.mean(predicted == y[split:]) * 100)}

    return build, batches, score


def _sort(keras, np, quick):
    length, vocabulary, width = 12, 10, 32 if quick else 64

    def make(count, seed):
        x = np.random.default_rng(seed).integers(0, vocabulary, (count, length))
        return x.astype("int32"), np.sort(x, axis=1).astype("int32")

    def build():
        tokens = keras.Input((length,), dtype="int32")
        h = keras.layers.Embedding(vocabulary, width)(tokens)
        positions = keras.ops.arange(length)[None, :]
        h = h + keras.layers.Embedding(length, width)(positions)
        for _ in range(2):
            attended = keras.layers.MultiHeadAttention(4, width // 4)(h, h)
            h = keras.layers.LayerNormalization()(h + attended)
            f = keras.layers.Dense(2 * width, activation="relu")(h)
            h = keras.layers.LayerNormalization()(
                h + keras.layers.Dense(width)(f)
            )
        logits = keras.layers.Dense(vocabulary)(h)
        logits = keras.layers.Activation("linear", dtype="float32")(logits)
        return keras.Model(tokens, logits)

    def batches(steps):
        return [make(64, 100 + step) for step in range(steps)]

    x_test, y_test = make(2000, 1)

    def score(model):
        predicted = np.argmax(model.predict(x_test, verbose=0), -1)
        right = predicted == y_test
        return {
            "accuracy": float(right.mean() * 100),
            "sequences": float(right.all(axis=1).mean() * 100),
        }

    return build, batches, score


def _accuracy(task, configs, steps, quick, learning_rate=1e-3):
    """Trains every configuration; returns {config: {scores, curve, ...}}."""
    keras, kmp = _setup()
    import numpy as np

    build, batches, score = {"digits": _digits, "sort": _sort}[task](
        keras, np, quick
    )
    keras.utils.set_random_seed(0)
    initial = build().get_weights()
    data = batches(steps)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = {}
    for config in configs:
        policy, make = _policy_and_optimizer(
            keras,
            kmp,
            config,
            lambda: keras.optimizers.schedules.CosineDecay(
                learning_rate, steps
            ),
        )
        with kmp.policy_scope(policy):
            model = build()
            model.set_weights(initial)
            model.compile(optimizer=make(), loss=loss_fn)

        start = time.perf_counter()
        curve = [float(model.train_on_batch(x, y)) for x, y in data]
        seconds = time.perf_counter() - start
        results[config] = {
            **score(model),
            "curve": curve,
            "final_loss": float(np.mean(curve[-max(1, steps // 20) :])),
            "seconds": seconds,
        }
        print(
            f"  {task} {config}: "
            + json.dumps(
                {
                    k: round(v, 4)
                    for k, v in results[config].items()
                    if k != "curve"
                }
            ),
            flush=True,
        )
    return results


# --- Memory (one subprocess per configuration) -------------------------------


def _allocator(keras):
    """`(reset_peak, current, peak)` of the backend's allocator, in bytes,
    or None where it keeps no statistics on this machine."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        memory = tf.config.experimental
        device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
        try:
            memory.get_memory_info(device)
        except ValueError:  # "Allocator stats not available for device"
            return None
        return (
            lambda: memory.reset_memory_stats(device),
            lambda: memory.get_memory_info(device)["current"],
            lambda: memory.get_memory_info(device)["peak"],
        )
    if backend == "jax":
        import jax

        device = jax.local_devices()[0]
        stats = device.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        # JAX cannot reset its peak: each step's is the run's so far.
        return (
            lambda: None,
            lambda: device.memory_stats()["bytes_in_use"],
            lambda: device.memory_stats()["peak_bytes_in_use"],
        )
    import torch

    if not torch.cuda.is_available():
        return None
    return (
        torch.cuda.reset_peak_memory_stats,
        torch.cuda.memory_allocated,
        torch.cuda.max_memory_allocated,
    )


def _memory_child(config, quick, steps):
    keras, kmp = _setup()
    import numpy as np

    units, batch = (64, 64) if quick else (4096, 8192)
    policy, make = _policy_and_optimizer(keras, kmp, config, lambda: 1e-4)
    keras.utils.set_random_seed(0)
    with kmp.policy_scope(policy):
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("linear", dtype="float32"),
            ]
        )
        optimizer = make()
        optimizer.build(model.trainable_variables)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x = keras.ops.convert_to_tensor(
        rng.standard_normal((batch, 784), dtype=np.float32)
    )
    y = keras.ops.convert_to_tensor(rng.integers(0, 10, (batch,)), "int32")
    model.train_on_batch(x, y)  # Traced or compiled, not measured.

    def size(values):
        return sum(
            int(np.prod(v.shape)) * keras.ops.convert_to_numpy(v).itemsize
            for v in values
        )

    allocator = _allocator(keras)
    before = allocator[1]() if allocator else None
    peaks, times = [], []
    for _ in range(steps):
        if allocator:
            allocator[0]()
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
        if allocator:
            peaks.append(allocator[2]() - before)
    result = {
        "weights": size(model.weights),
        "optimizer": size(optimizer.variables),
        "peaks": peaks if allocator else None,
        "step_seconds": statistics.median(times[1:] or times),
    }
    print(json.dumps(result), flush=True)


def _memory(configs, quick, steps):
    results = {}
    for config in configs:
        command = [sys.executable, os.path.abspath(__file__), "--child", config]
        command += ["--memory-steps", str(steps)] + (
            ["--quick"] if quick else []
        )
        done = subprocess.run(command, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            sys.stderr.write(done.stderr[-3000:])
            raise RuntimeError(f"measuring {config} failed ({done.returncode})")
        result = json.loads(lines[-1])
        if result["peaks"] is None:
            result["peak"] = result["total"] = None
            total = f"allocator peak {NOT_MEASURABLE}"
        else:
            result["peak"] = statistics.median(result["peaks"])
            result["total"] = (
                result["weights"] + result["optimizer"] + result["peak"]
            )
            total = f"{result['total'] / MEGABYTE:.1f} MB"
        results[config] = result
        print(f"  memory {config}: {total}", flush=True)
    return results


# --- Report -------------------------------------------------------------------


def _print_accuracy(task, results):
    reference = results.get("float32")
    rows = []
    for config, result in results.items():
        behind = (
            "-"
            if reference is None
            else f"{reference['accuracy'] - result['accuracy']:+.2f}"
        )
        rows.append(
            [
                config,
                f"{result['accuracy']:.2f}",
                f"{result['sequences']:.2f}" if "sequences" in result else "-",
                behind,
                f"{result['final_loss']:.4f}",
                f"{result['seconds']:.1f}",
            ]
        )
    print(
        f"\n{task}: accuracy (%) and final training loss (mean of the last 5%)"
    )
    report.print_table(
        (
            "config",
            "accuracy",
            "sequences",
            "points behind float32",
            "final loss",
            "train s",
        ),
        rows,
    )


def _print_memory(results):
    reference = results.get("float32")
    rows = []
    for config, r in results.items():
        ratio = (
            "-"
            if reference is None
            or reference["total"] is None
            or r["total"] is None
            else f"{r['total'] / reference['total']:.2f}x"
        )
        if r["peak"] is None:
            peak, total = NOT_MEASURABLE, "-"
        else:
            peak = (
                f"{r['peak'] / MEGABYTE:.1f} [{min(r['peaks']) / MEGABYTE:.1f}-"
                f"{max(r['peaks']) / MEGABYTE:.1f}]"
            )
            total = f"{r['total'] / MEGABYTE:.1f}"
        rows.append(
            [
                config,
                f"{r['weights'] / MEGABYTE:.1f}",
                f"{r['optimizer'] / MEGABYTE:.1f}",
                peak,
                total,
                ratio,
                f"{r['step_seconds'] * 1000:.0f}",
            ]
        )
    print("\nmemory: MLP 784-4096-4096-10, Adam, batch 8192 (MB = 2**20 bytes)")
    report.print_table(
        (
            "config",
            "weights",
            "optimizer",
            "allocator peak [min-max]",
            "total",
            "/ float32",
            "step ms",
        ),
        rows,
    )


def _goals(accuracy, memory):
    print("Goals:")
    for task, results in accuracy.items():
        if "float32" not in results:
            continue
        want = results["float32"]["accuracy"] - ACCURACY_GOAL
        for config in ("bf16+kahan", "bf16+stochastic"):
            if config in results:
                got = results[config]["accuracy"]
                verdict = "met" if got >= want else "NOT met"
                print(
                    f"  {task} {config}: {got:.2f}% >= float32 - "
                    f"{ACCURACY_GOAL} = {want:.2f}%: {verdict}"
                )
    if memory and "float32" in memory:
        for config in ("bf16+kahan", "bf16+stochastic"):
            if config not in memory:
                continue
            if None in (memory[config]["total"], memory["float32"]["total"]):
                print(
                    f"  memory {config}: {NOT_MEASURABLE} (the allocator "
                    "keeps no statistics of its peak here)"
                )
                continue
            ratio = memory[config]["total"] / memory["float32"]["total"]
            verdict = "met" if ratio <= MEMORY_GOAL else "NOT met"
            print(
                f"  memory {config}: {ratio:.2f}x of float32 <= "
                f"{MEMORY_GOAL}x: {verdict}"
            )


def _plot(accuracy, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(
        1, len(accuracy), figsize=(6 * len(accuracy), 4.5), squeeze=False
    )
    for axis, (task, results) in zip(axes[0], accuracy.items()):
        for config, result in results.items():
            curve = np.asarray(result["curve"])
            window = max(1, len(curve) // 50)
            smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
            axis.plot(smooth, label=config, linewidth=1.2)
        axis.set_yscale("log")
        axis.set_title(f"{task}: training loss (moving mean of {window} steps)")
        axis.set_xlabel("step")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"loss curves written: {path}")


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tasks",
        type=report.names_among(TASKS),
        default=list(TASKS),
        help="comma-separated, among digits, sort, memory (default all)",
    )
    parser.add_argument(
        "--configs",
        type=report.names_among(CONFIGS),
        default=list(CONFIGS),
        help="comma-separated configurations (default all)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per accuracy task (default 3000 digits, "
        "1500 sort; --quick: 20)",
    )
    parser.add_argument(
        "--memory-steps",
        type=int,
        default=None,
        help="measured steps per memory subprocess (default 6; --quick 2)",
    )
    parser.add_argument(
        "--plot", default="bf16_all_the_way.png", help="loss-curve PNG path"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models, 20 steps, 2 configurations' memory: checks that "
        "it runs; the numbers mean nothing",
    )
    report.add_results_argument(parser, "bf16_all_the_way.json (TensorFlow)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def _results_tables(accuracy, memory, suffix):
    """The result file's tables (`suffix`: ", JAX" off TensorFlow)."""
    scores, losses, goals = [], [], {}
    for task, results in accuracy.items():
        kinds = [("accuracy", task)]
        if task == "sort":
            kinds = [
                ("accuracy", "sort: tokens"),
                ("sequences", "sort: sequences"),
            ]
        for key, group in kinds:
            for config, result in results.items():
                scores.append(
                    {
                        "group": group + suffix,
                        "series": SERIES.get(config, config),
                        "value": round(result[key], 2),
                    }
                )
        if "float32" in results:
            want = results["float32"]["accuracy"] - ACCURACY_GOAL
            goals[kinds[0][1] + suffix] = {"op": ">=", "value": round(want, 2)}
        for config, result in results.items():
            losses.append(
                {
                    "group": task + suffix,
                    "series": SERIES.get(config, config),
                    "value": round(result["final_loss"], 4),
                }
            )
    tables = [
        {
            "caption": "Test accuracy, %",
            "unit": "%",
            "decimals": 2,
            "signed": False,
            "better": "higher",
            "goals": goals,
            "measurements": scores,
        },
        {
            "caption": "Final training loss (mean of the last 5% of steps)",
            "unit": "",
            "decimals": 4,
            "better": "lower",
            "log": True,
            "measurements": losses,
        },
    ]
    reference = memory.get("float32", {}).get("total")
    measured = {c: r for c, r in memory.items() if r["total"] is not None}
    if reference and measured:
        group = "MLP, batch 8192" + suffix
        tables.append(
            {
                "caption": "Training memory of the 20M-parameter MLP at "
                "batch 8192, / float32",
                "unit": "x",
                "decimals": 2,
                "better": "lower",
                "goals": {group: {"op": "<=", "value": MEMORY_GOAL}},
                "measurements": [
                    {
                        "group": group,
                        "series": SERIES.get(config, config),
                        "value": round(r["total"] / reference, 2),
                    }
                    for config, r in measured.items()
                ],
            }
        )
        parts = []
        for config, r in measured.items():
            peaks = [p / MEGABYTE for p in r["peaks"]]
            for series, value in (
                ("weights", r["weights"] / MEGABYTE),
                ("optimizer", r["optimizer"] / MEGABYTE),
                ("allocator peak", r["peak"] / MEGABYTE),
                ("total", r["total"] / MEGABYTE),
            ):
                row = {
                    "group": SERIES.get(config, config) + suffix,
                    "series": series,
                    "value": round(value, 1),
                }
                if series == "allocator peak":
                    row["range"] = [round(min(peaks), 1), round(max(peaks), 1)]
                parts.append(row)
        tables.append(
            {
                "caption": "Training memory, MiB: weights, optimizer "
                "variables, allocator peak per step [min, max], total",
                "unit": "MiB",
                "decimals": 1,
                "better": "lower",
                "measurements": parts,
            }
        )
    return [table for table in tables if table["measurements"]]


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.memory_steps is None:
        args.memory_steps = 2 if args.quick else 6
    if args.child:
        _memory_child(args.child, args.quick, args.memory_steps)
        return 0
    report.print_machine("bfloat16 all the way")
    keras, _ = _setup()
    backend = keras.backend.backend()
    results_file = report.results_path(
        parser, args, RESULTS.get(backend, OTHER_BACKENDS_RESULTS)
    )
    print(f"{'keras backend':>16}: {keras.backend.backend()}")
    print(f"{'cpu flags':>16}: {report.cpu_flags('bf16')}")
    if args.quick:
        print(f"{'':>16}  --quick: tiny sizes; the numbers mean nothing")
    accuracy, memory = {}, {}
    for task in args.tasks:
        if task == "memory":
            configs = args.configs
            if args.quick:
                configs = [c for c in configs if c in ("float32", "bf16+kahan")]
            memory = _memory(configs, args.quick, args.memory_steps)
            continue
        steps = args.steps or (
            20 if args.quick else {"digits": 3000, "sort": 1500}[task]
        )
        accuracy[task] = _accuracy(task, args.configs, steps, args.quick)
    for task, results in accuracy.items():
        _print_accuracy(task, results)
    if memory:
        _print_memory(memory)
    _goals(accuracy, memory)
    if accuracy and args.plot:
        _plot(accuracy, args.plot)
    suffix = "" if backend == "tensorflow" else f", {BACKEND_NAMES[backend]}"
    report.write_results(
        results_file,
        script=report.script_path(__file__),
        title="bfloat16 all the way on JAX and torch"
        if suffix
        else "bfloat16 all the way: kmp.LowPrecisionOptimizer",
        about="bfloat16 weights and Adam slots trained with "
        "`kmp.LowPrecisionOptimizer` (Kahan compensation, stochastic "
        "rounding, or rounding to nearest) against float32, mixed "
        "precision and Keras's Adam on bfloat16 as it is, at the same "
        "steps, seeds, initial weights and batches, with Keras's own step "
        "(`train_on_batch`). Tasks: scikit-learn's digits (MLP "
        "64-256-256-10, 3000 steps of 32, 397 test images); sorting 12 "
        "generated digits (a 2-block Transformer encoder, width 64, 1500 "
        "steps of 64, 2000 test sequences); the training memory of the MLP "
        "784-4096-4096-10 (20M parameters) with Adam at batch 8192. Guide: "
        "`guides/bfloat16_weights.py`.",
        tables=_results_tables(accuracy, memory, suffix),
        notes=[
            "Keras's own Adam does not move bfloat16 variables at all (it "
            "computes `beta_2 ** step` in bfloat16, where 0.999 is 1.0).",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
