"""Training memory of the MLP in Keras 3 against the same math in raw TF.

Runs one configuration per process (this script re-runs itself): the
784-4096-4096-10 MLP at batch 8192 under float32 or mixed_bfloat16, built
either from Keras layers or from plain `tf.Variable`s and `tf.matmul` with
one cast per weight; both keep the last layer in float32, so under
mixed_bfloat16 its input is a float32 copy of the last hidden activation.
Each process traces an Adam step, then runs `--steps` steps and reads
TensorFlow's own allocator peak during each
(`tf.config.experimental.get_memory_info("CPU:0")`) minus what was allocated
before the first (weights, slots, data). The peak depends on the order in
which the executor runs independent ops, which varies from step to step and
from process to process, so every step is a sample: the script prints the
median of all steps of `--repeats` processes with their range, then the
bf16 / float32 ratios of the medians. Equal bfloat16 rows mean Keras's
layers keep nothing beyond the math itself.
`memory_breakdown.py` takes the step apart further.

    python benchmarks/diagnostics/memory_keras_vs_raw.py
    python benchmarks/diagnostics/memory_keras_vs_raw.py --repeats 3 --steps 8
    python benchmarks/diagnostics/memory_keras_vs_raw.py --quick  # it runs
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The allocator whose statistics are read: TensorFlow's BFC allocator, which
# it uses on the CPU only with oneDNN on (its default on CPUs with AVX-512 or
# AMX, not on AVX2 ones: there `get_memory_info("CPU:0")` raises "Allocator
# stats not available"). Asked for, the measure is the same on every CPU.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

BATCH, UNITS = 8192, 4096
QUICK_BATCH, QUICK_UNITS = 64, 32  # --quick: the numbers mean nothing
KINDS = ("keras", "raw")
POLICIES = ("float32", "mixed_bfloat16")


def _measure(kind, policy, steps, quick=False):
    import keras
    import tensorflow as tf

    batch, units = (QUICK_BATCH, QUICK_UNITS) if quick else (BATCH, UNITS)
    tf.random.set_seed(0)
    x = tf.random.normal((batch, 784))
    y = tf.random.uniform((batch,), 0, 10, tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "keras":
        keras.config.set_dtype_policy(policy)
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(10, dtype="float32"),
            ]
        )
        variables = model.trainable_variables
        forward = model
    else:
        compute = tf.bfloat16 if policy == "mixed_bfloat16" else tf.float32
        shapes = [(784, units), (units,), (units, units), (units,)]
        shapes += [(units, 10), (10,)]
        variables = [tf.Variable(tf.random.normal(s) * 0.01) for s in shapes]

        def forward(inputs):
            hidden = tf.cast(inputs, compute)
            for i in (0, 2):
                kernel = tf.cast(variables[i], compute)
                bias = tf.cast(variables[i + 1], compute)
                hidden = tf.nn.relu(tf.matmul(hidden, kernel) + bias)
            hidden = tf.cast(hidden, tf.float32)
            return tf.matmul(hidden, variables[4]) + variables[5]

    optimizer = keras.optimizers.Adam()
    optimizer.build(variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, forward(x))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    step.get_concrete_function()
    memory = tf.config.experimental
    allocated = memory.get_memory_info("CPU:0")["current"]
    peaks = []
    for _ in range(steps):
        memory.reset_memory_stats("CPU:0")
        step().numpy()
        peaks.append(memory.get_memory_info("CPU:0")["peak"] - allocated)
    print(json.dumps(peaks))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="subprocesses per configuration (default 2)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=6,
        help="measured steps per subprocess (default 6)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny MLP, one process and one step per configuration: "
        "checks that the script runs; the numbers mean nothing",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 1
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    if args.child:
        _measure(*args.child, args.steps, args.quick)
        return 0
    medians = {}
    for kind in KINDS:
        for policy in POLICIES:
            samples = []
            for _ in range(args.repeats):
                output = subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--child",
                        kind,
                        policy,
                        "--steps",
                        str(args.steps),
                        *(["--quick"] if args.quick else []),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                samples += json.loads(output.strip().splitlines()[-1])
            samples = [value / 2**20 for value in samples]
            medians[kind, policy] = statistics.median(samples)
            print(
                f"{kind:5s} {policy:14s} allocator peak beyond what was "
                f"allocated before: median {medians[kind, policy]:6.1f} MB "
                f"[{min(samples):.1f}-{max(samples):.1f}] over "
                f"{len(samples)} steps",
                flush=True,
            )
    for kind in KINDS:
        base = medians[kind, POLICIES[0]]
        if base == 0:  # --quick: too small for the allocator to show.
            print(f"{kind:5s} bf16 / float32: - (float32 peak 0 MB)")
            continue
        ratio = medians[kind, POLICIES[1]] / base
        print(f"{kind:5s} bf16 / float32: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
