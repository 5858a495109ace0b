"""Where mixed_bfloat16 training memory goes, one variation at a time.

Each row of the table changes one thing in the training step of the memory
benchmark's models (`memory.py`: the MLP 784-4096-4096-10 at batch 8192, the
CNN at batch 64, float32 logits, Adam) and measures it under float32 and
mixed_bfloat16. Every (variation, policy) runs in a fresh subprocess, which
traces the step, then runs `--steps` steps and reads TensorFlow's allocator
peak during each (`tf.config.experimental.get_memory_info("CPU:0")`) minus
what was allocated before the first step (weights, optimizer slots, the
batch). The allocator counts tensor bytes, so the number does not depend on
how the C library hands memory back; it does depend on the order in which
TensorFlow's executor happens to run independent ops, which changes from step
to step and from process to process. So every step is one sample: the table
gives the median of all steps of all `--repeats` processes and their range,
and the ratio of the two medians.

Variations (combine them with "+", e.g. `recast-kernels+fused-adam`):

* `keras`: the benchmark as it is (Keras 3 layers, Keras 3 Adam), with kmp
  imported, so with the patches `import kmp` installs in effect (see `kmp
  patches`): recurrent-layer casts (`kmp/patches/recurrent.py`) and float32
  Dense layers that keep a low-precision input (`kmp/patches/dense.py`).
* `kmp-mean`: kmp's bfloat16 mean patch (`kmp/patches/mean.py`, off by
  default) installed as well.
* `keras-as-is`: the same with kmp's patches to Keras's mean, recurrent
  layers and Dense uninstalled: Keras 3 alone.
* `no-update`: forward and backward only; no optimizer step.
* `sgd`: plain SGD instead of Adam.
* `fused-adam`: `kmp.FusedAdam`: Adam's slots updated in place by
  TensorFlow's `ResourceApplyAdam` kernel (no temporaries the size of a
  weight).
* `barrier`: every gradient is computed before the first update starts.
* `bf16-input`: the batch is handed over in bfloat16 already.
* `bf16-logits`: the last Dense computes in the policy's dtype and a float32
  `Activation("linear")` casts the logits (Keras's guide's layout).
* `recast-kernels`: the MLP's bfloat16 hidden layers cast their float32
  kernel again in the backward pass instead of keeping its bfloat16 copy
  (same numbers, one more cast per step).
* `blocked-input-gradient`: the `dense` patch makes the float32 logits layer's
  input gradient in four row blocks, each cast to bfloat16 at once, instead
  of one float32 product (may round differently in the last bit).
* `mean-no-upcast`: the CNN's global average pooling in the compute dtype
  (Keras 3's `ops.mean` first casts bfloat16 inputs to float32).
* `bias-add`: the CNN's convolutions add their bias with `tf.nn.bias_add`,
  as tf_keras does (Keras 3 uses a broadcasting add).
* `tf_keras`: the same model and Adam in tf_keras (Keras 2), run with
  `--tf-keras-python` (an interpreter with tf_keras installed; this one if
  omitted and tf_keras is importable, else the row is skipped).

    python benchmarks/memory_breakdown.py             # both models, ~15 min
    python benchmarks/memory_breakdown.py --models mlp --variants keras,sgd
    python benchmarks/memory_breakdown.py --tf-keras-python /tmp/tfk/bin/python
    python benchmarks/memory_breakdown.py --quick     # checks that it runs

`--at-peak N` also records one more step of each configuration with
TensorFlow's profiler and lists the N largest tensors alive at the moment
the step's memory peaks (the op that made each, its shape and dtype):

    python benchmarks/memory_breakdown.py --models mlp --variants keras \
        --repeats 1 --at-peak 8

`--results` writes the rows of `keras`, `keras-as-is` and `tf_keras` (kmp
against Keras 3 alone and Keras 2) to
`benchmarks/results/memory_breakdown.json`, the performance page's table.
"""

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

# The allocator whose statistics are read: TensorFlow's BFC allocator, which
# it uses on the CPU only with oneDNN on (its default on CPUs with AVX-512 or
# AMX, not on AVX2 ones: there `get_memory_info("CPU:0")` raises "Allocator
# stats not available"). Asked for, the measure is the same on every CPU.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import report  # noqa: E402

GOAL = 0.55
POLICIES = ("float32", "mixed_bfloat16")
MODELS = ("mlp", "cnn")
SIZES = {
    "mlp": {"inputs": 784, "units": 4096, "batch": 8192},
    "cnn": {"image": 64, "filters": 64, "batch": 64},
}
QUICK_SIZES = {
    "mlp": {"inputs": 784, "units": 64, "batch": 64},
    "cnn": {"image": 16, "filters": 8, "batch": 4},
}
MODIFIERS = {
    "keras": "the benchmark as it is, through kmp",
    "kmp-mean": "and kmp's bfloat16 mean patch (off by default)",
    "keras-as-is": "Keras 3 alone (kmp's mean, RNN casts and Dense off)",
    "no-update": "forward and backward, no optimizer step",
    "sgd": "plain SGD instead of Adam",
    "fused-adam": "kmp.FusedAdam (ResourceApplyAdam, in place)",
    "barrier": "all gradients before the first update",
    "bf16-input": "batch handed over in bfloat16",
    "bf16-logits": "last Dense in bfloat16, float32 Activation",
    "recast-kernels": "hidden kernels cast again in the backward pass",
    "blocked-input-gradient": "logits' input gradient in 4 row blocks",
    "mean-no-upcast": "global average pooling in bfloat16",
    "bias-add": "convolutions add their bias with tf.nn.bias_add",
    "tf_keras": "tf_keras (Keras 2) layers and Adam",
}
DEFAULT_VARIANTS = {
    "mlp": (
        "keras",
        "keras-as-is",
        "tf_keras",
        "no-update",
        "sgd",
        "fused-adam",
        "barrier",
        "bf16-input",
        "bf16-logits",
        "recast-kernels",
        "blocked-input-gradient",
    ),
    "cnn": (
        "keras",
        "kmp-mean",
        "keras-as-is",
        "tf_keras",
        "no-update",
        "fused-adam",
        "bf16-input",
        "mean-no-upcast",
        "bias-add",
        "bias-add+mean-no-upcast",
    ),
}
MEGABYTE = 2**20
RESULTS = "memory_breakdown.json"
# The variants --results writes, as the page names them.
RESULT_SERIES = {
    "keras": "through kmp",
    "keras-as-is": "Keras 3 alone",
    "tf_keras": "tf_keras",
}


# --- One measurement (runs in a child process) --------------------------------


def _child(
    model_name: str, policy: str, variant: str, quick: bool, steps, at_peak=0
):
    """Measures one configuration; prints its per-step peaks as JSON.

    With `at_peak`, also the `at_peak` largest tensors alive at the peak of
    one more, profiled, step (`_alive_at_peak`).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np
    import tensorflow as tf

    flags = set(variant.split("+"))
    if "tf_keras" in flags:
        import tf_keras as k

        k.mixed_precision.set_global_policy(policy)
    else:
        import keras as k

        import kmp

        kmp.set_global_policy(policy)
        if "kmp-mean" in flags:
            kmp.patches.install("mean")
        if "keras-as-is" in flags:
            kmp.patches.uninstall("mean", "recurrent", "dense")
        if "blocked-input-gradient" in flags:
            from kmp.patches import dense

            dense.input_gradient = _blocked_input_gradient(tf)
    k.utils.set_random_seed(0)
    sizes = (QUICK_SIZES if quick else SIZES)[model_name]
    model = _build_model(k, tf, model_name, sizes, flags)
    rng = np.random.default_rng(0)
    if model_name == "mlp":
        shape = (sizes["batch"], sizes["inputs"])
    else:
        shape = (sizes["batch"], sizes["image"], sizes["image"], 3)
    x = tf.constant(rng.standard_normal(shape, dtype=np.float32))
    if "bf16-input" in flags and policy == "mixed_bfloat16":
        x = tf.cast(x, tf.bfloat16)
    y = tf.constant(rng.integers(0, 10, (sizes["batch"],)).astype("int32"))
    step = _make_step(k, tf, model, flags)
    step.get_concrete_function(x, y)

    memory = tf.config.experimental
    before = memory.get_memory_info("CPU:0")["current"]
    peaks = []
    for _ in range(steps):
        memory.reset_memory_stats("CPU:0")
        loss = float(step(x, y).numpy())
        peaks.append(memory.get_memory_info("CPU:0")["peak"] - before)
    result = {"peaks": peaks, "loss": loss}
    if at_peak:
        result["alive"] = _alive_at_peak(tf, lambda: step(x, y), at_peak)
    print(json.dumps(result), flush=True)


def _alive_at_peak(tf, run_step, count):
    """The `count` largest tensors alive when one step's memory peaks.

    The step runs under TensorFlow's profiler (host tracer level 3, which
    records every allocation and deallocation with the op that made it);
    replaying those events in time order finds the moment the bytes
    allocated during the step were highest and what was alive then. Tensors
    allocated before the step (weights, slots, the batch) are not in it.
    Returns `[megabytes, op, shape, dtype]` lists, largest first.
    """
    from diagnostics.op_profile import _load_xspace

    directory = tempfile.mkdtemp(prefix="kmp-memory-")
    try:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=3)
        tf.profiler.experimental.start(directory, options=options)
        try:
            run_step().numpy()
        finally:
            tf.profiler.experimental.stop()
        space = _load_xspace(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    events = []
    for plane in space.planes:
        names = plane.stat_metadata
        for line in plane.lines:
            origin = line.timestamp_ns * 1000
            for event in line.events:
                kind = plane.event_metadata[event.metadata_id].name
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for stat in event.stats:
                    key = names[stat.metadata_id].name
                    if stat.HasField("ref_value"):
                        stats[key] = names[stat.ref_value].name
                    elif stat.HasField("str_value"):
                        stats[key] = stat.str_value
                    else:
                        stats[key] = stat.int64_value or stat.uint64_value
                events.append((origin + event.offset_ps, kind, stats))
    events.sort(key=lambda event: event[0])
    alive, in_use, peak, at_peak = {}, 0, 0, {}
    for _, kind, stats in events:
        address = stats.get("addr")
        if kind == "MemoryAllocation":
            size = int(stats.get("requested_bytes") or 0)
            dtype = stats.get("data_type")
            try:
                dtype = tf.dtypes.as_dtype(int(dtype)).name
            except (TypeError, ValueError):
                dtype = str(dtype)
            alive[address] = (
                size,
                str(stats.get("tf_op", "?")),
                str(stats.get("shape", "")),
                dtype,
            )
            in_use += size
            if in_use > peak:
                peak, at_peak = in_use, dict(alive)
        elif address in alive:
            in_use -= alive.pop(address)[0]
    largest = sorted(at_peak.values(), key=lambda item: -item[0])[:count]
    return [
        [size / MEGABYTE, op, shape, dtype]
        for size, op, shape, dtype in largest
    ]


def _build_model(k, tf, name, sizes, flags):
    """The memory benchmark's model, with the layers `flags` change."""
    layers = k.layers

    if "bf16-logits" in flags:
        logits = [
            layers.Dense(10, name="logits"),
            layers.Activation("linear", dtype="float32"),
        ]
    else:
        logits = [layers.Dense(10, dtype="float32", name="logits")]

    if name == "mlp":
        hidden = layers.Dense
        if "recast-kernels" in flags:
            hidden = _recast_dense_class(k, tf)
        return k.Sequential(
            [
                k.Input((sizes["inputs"],)),
                hidden(sizes["units"], activation="relu"),
                hidden(sizes["units"], activation="relu"),
                *logits,
            ]
        )

    class BiasAddConv(k.layers.Layer):
        """3x3 'same' convolution + tf.nn.bias_add + ReLU (as tf_keras)."""

        def __init__(self, filters):
            super().__init__()
            self.filters = filters

        def build(self, input_shape):
            self.kernel = self.add_weight(
                shape=(3, 3, input_shape[-1], self.filters),
                initializer="glorot_uniform",
            )
            self.bias = self.add_weight(
                shape=(self.filters,), initializer="zeros"
            )

        def call(self, inputs):
            outputs = tf.nn.convolution(inputs, self.kernel, padding="SAME")
            return tf.nn.relu(tf.nn.bias_add(outputs, self.bias))

    class SpatialMean(k.layers.Layer):
        """Global average pooling in the input's dtype."""

        def call(self, inputs):
            return tf.reduce_mean(inputs, axis=[1, 2])

    def conv(filters):
        if "bias-add" in flags:
            return BiasAddConv(filters)
        return layers.Conv2D(filters, 3, padding="same", activation="relu")

    filters = sizes["filters"]
    return k.Sequential(
        [
            k.Input((sizes["image"], sizes["image"], 3)),
            conv(filters),
            conv(filters),
            layers.MaxPooling2D(),
            conv(2 * filters),
            conv(2 * filters),
            SpatialMean()
            if "mean-no-upcast" in flags
            else layers.GlobalAveragePooling2D(),
            *logits,
        ]
    )


def _recast_dense_class(k, tf):
    """A Dense whose backward pass casts its float32 kernel again.

    Keras keeps the kernel's low-precision copy from the forward pass for
    the input's gradient; this layer lets it go and casts again when the
    gradient needs it (the same values: casting is deterministic).
    """
    from tensorflow.python.ops import gen_math_ops

    class RecastDense(k.layers.Dense):
        def call(self, inputs, training=None):
            @tf.custom_gradient
            def product(inputs, kernel):
                def gradient(upstream):
                    with tf.control_dependencies([upstream]):
                        low = tf.cast(kernel, inputs.dtype)
                    d_kernel = gen_math_ops.mat_mul(
                        inputs, upstream, transpose_a=True, grad_b=True
                    )
                    d_inputs = gen_math_ops.mat_mul(
                        upstream, low, transpose_b=True, grad_a=True
                    )
                    return d_inputs, tf.cast(d_kernel, kernel.dtype)

                return tf.matmul(inputs, tf.cast(kernel, inputs.dtype)), (
                    gradient
                )

            # The float32 variable itself, not the layer's autocast copy.
            with k.src.backend.AutocastScope(None):
                kernel = tf.convert_to_tensor(self._kernel.value)
            outputs = product(inputs, kernel)
            outputs = k.ops.add(outputs, self.bias)
            return self.activation(outputs)

    return RecastDense


def _blocked_input_gradient(tf, blocks=4):
    """kmp's `dense` patch's input gradient, in row blocks cast one by one."""
    from tensorflow.python.ops import gen_math_ops

    def input_gradient(upstream, kernel, dtype):
        parts = []
        for rows in tf.split(upstream, blocks):
            # After the previous block: one float32 block alive at once.
            with tf.control_dependencies(parts[-1:]):
                part = gen_math_ops.mat_mul(
                    rows, kernel, transpose_b=True, grad_a=True
                )
                parts.append(tf.cast(part, dtype))
        return tf.concat(parts, 0)

    return input_gradient


def _make_step(k, tf, model, flags):
    """The training step (a tf.function of the batch) `flags` describe."""
    loss_fn = k.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    if "sgd" in flags:
        optimizer = k.optimizers.SGD(1e-4)
    elif "fused-adam" in flags:
        import kmp

        optimizer = kmp.FusedAdam(1e-4)
    else:
        optimizer = k.optimizers.Adam(1e-4)
    optimizer.build(variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        if "no-update" in flags:
            # Consume every gradient, so none is pruned, and keep none.
            return loss + 0.0 * tf.add_n([tf.reduce_sum(g) for g in grads])
        if "barrier" in flags:
            with tf.control_dependencies(grads):
                grads = [tf.identity(g) for g in grads]
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    return step


# --- The table (parent process) -----------------------------------------------


def _run_child(args, model, policy, variant, python, at_peak=0):
    command = [
        python,
        os.path.abspath(__file__),
        "--child",
        model,
        policy,
        variant,
        "--steps",
        str(args.steps),
    ]
    if args.quick:
        command.append("--quick")
    if at_peak:
        command += ["--at-peak", str(at_peak)]
    completed = subprocess.run(
        command, capture_output=True, text=True, check=False
    )
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        sys.stderr.write(completed.stderr[-3000:])
        raise RuntimeError(
            f"measuring {model} {policy} {variant} failed with exit code "
            f"{completed.returncode}"
        )
    return json.loads(lines[-1])


def _variant_list(text: str):
    variants = text.split(",")
    for variant in variants:
        for modifier in variant.split("+"):
            if modifier not in MODIFIERS:
                raise argparse.ArgumentTypeError(
                    f"unknown variation {modifier!r}; choose among "
                    f"{', '.join(MODIFIERS)}"
                )
    return variants


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        type=report.names_among(MODELS),
        default=list(MODELS),
        help="comma-separated, among mlp, cnn (default both)",
    )
    parser.add_argument(
        "--variants",
        type=_variant_list,
        default=None,
        help="comma-separated variations (default: all that apply to the "
        "model; see the module docstring)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="subprocesses per configuration (default 2)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per subprocess (default 6)",
    )
    parser.add_argument(
        "--tf-keras-python",
        default=None,
        help="Python interpreter with tf_keras installed, for the tf_keras "
        "rows (default: this one, if tf_keras is importable)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, one repeat of two steps: checks that it runs",
    )
    parser.add_argument(
        "--at-peak",
        type=int,
        default=0,
        metavar="N",
        help="also list the N largest tensors alive at one profiled step's "
        "memory peak, per configuration (default 0: no profiling)",
    )
    report.add_results_argument(parser, RESULTS)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return parser


def _summary(samples):
    if not samples:
        return "skipped", None
    median = statistics.median(samples) / MEGABYTE
    low, high = min(samples) / MEGABYTE, max(samples) / MEGABYTE
    return f"{median:.1f} [{low:.1f}-{high:.1f}]", median


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.quick else 6
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    if args.at_peak < 0:
        parser.error(f"--at-peak must be 0 or more, not {args.at_peak}")
    results = report.results_path(parser, args, RESULTS)
    if results and args.variants and not set(args.variants) & {*RESULT_SERIES}:
        parser.error(
            f"--results keeps only {', '.join(RESULT_SERIES)}: "
            "--variants names none"
        )
    if args.child:
        _child(
            *args.child,
            quick=args.quick,
            steps=args.steps,
            at_peak=args.at_peak,
        )
        return 0

    tf_keras_python = args.tf_keras_python
    if tf_keras_python is None and importlib.util.find_spec("tf_keras"):
        tf_keras_python = sys.executable
    report.print_machine("Training memory, variation by variation")
    print(
        f"{'measure':>16}: TensorFlow allocator peak per step minus what was "
        f"allocated before; {args.steps} steps x {args.repeats} "
        "subprocess(es) per cell: median [min-max] in MB (2**20 bytes)"
    )
    print(f"{'tf_keras python':>16}: {tf_keras_python or 'none: skipped'}")
    if args.quick:
        print(f"{'':>16}  --quick: tiny sizes; the numbers mean nothing")
    print(flush=True)

    rows, alive, measurements = [], [], []
    for model in args.models:
        for variant in args.variants or DEFAULT_VARIANTS[model]:
            python = sys.executable
            if "tf_keras" in variant.split("+"):
                python = tf_keras_python
            cells, medians = [], []
            for policy in POLICIES:
                samples = []
                for repeat in range(args.repeats if python else 0):
                    # Profile in the first process only: one list suffices.
                    at_peak = args.at_peak if repeat == 0 else 0
                    result = _run_child(
                        args, model, policy, variant, python, at_peak
                    )
                    samples += result["peaks"]
                    if "alive" in result:
                        alive.append((model, variant, policy, result["alive"]))
                text, median = _summary(samples)
                cells.append(text)
                medians.append(median)
            if None in medians or not medians[0]:
                ratio = "-"
            else:
                ratio = f"{medians[1] / medians[0]:.2f}x"
                if variant in RESULT_SERIES:
                    batch = (QUICK_SIZES if args.quick else SIZES)[model]
                    measurements.append(
                        {
                            "group": f"{model} (batch {batch['batch']})",
                            "series": RESULT_SERIES[variant],
                            "value": round(medians[1] / medians[0], 2),
                            "run": f"{medians[1]:.0f} / {medians[0]:.0f} MB",
                        }
                    )
            description = " + ".join(
                MODIFIERS[name] for name in variant.split("+")
            )
            rows.append([model, variant, *cells, ratio, description])
            print(f"  {'  '.join(rows[-1][:5])}", flush=True)
    print()
    report.print_table(
        (
            "model",
            "variant",
            "float32 MB",
            "mixed_bfloat16 MB",
            "ratio",
            "what changes",
        ),
        rows,
    )
    print(f"Goal: mixed_bfloat16 / float32 <= {GOAL}x.")
    report.write_results(
        results,
        script=report.script_path(__file__),
        title="Allocator peak beyond the weights, mixed_bfloat16 / float32 "
        "(TensorFlow)",
        about="TensorFlow's allocator peak per training step, beyond what "
        "was allocated before the first step (weights, optimizer slots, "
        "the batch), under mixed_bfloat16 over float32's (0.5x = half the "
        "memory): through kmp, with Keras 3 alone (kmp's patches off) and "
        "with tf_keras (Keras 2). Median of every step of every process "
        "per cell; the run column gives the two medians (MiB).",
        tables=[
            {
                "caption": "Allocator peak beyond the weights, "
                "mixed_bfloat16 / float32",
                "unit": "x",
                "decimals": 2,
                "better": "lower",
                "goals": {
                    row["group"]: {"op": "<=", "value": GOAL}
                    for row in measurements
                },
                "measurements": measurements,
            }
        ],
        notes=[
            "Which tensors the executor keeps alive at the peak changes "
            "from step to step and from process to process, so the same "
            "command can give ratios a tenth apart.",
        ],
    )
    for model, variant, policy, tensors in alive:
        print(
            f"\nAlive at the peak of one profiled step: {model} {variant} "
            f"{policy} (MB, the op that made it, shape, dtype)"
        )
        if not tensors:
            print("  (the profiler recorded no allocation during the step)")
            continue
        report.print_table(
            ("MB", "made by", "shape", "dtype"),
            [
                [f"{size:.1f}", op, shape, dtype]
                for size, op, shape, dtype in tensors
            ],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
